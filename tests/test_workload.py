"""The vocabulary bench and sim share: typed results that round-trip through today's JSON,
read older files, and read by their JSON keys; a sweep's points; compare() driving any
Measure (here a stand-in: no server, no simulator)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from loom.bench.compare import compare
from loom.workload.arrivals import Burst
from loom.workload.figures import request_figures
from loom.workload.load import Load
from loom.workload.monitoring import ClientFigures, ServerFigures
from loom.workload.requests import OK, REJECTED, RequestResult
from loom.workload.results import (
    CompareResult,
    Limits,
    Origin,
    RunResult,
    SweepResult,
    load_result,
    save_json,
)
from loom.workload.slo import Slo
from loom.workload.sweeps import SweepSpec
from loom.workload.trace import Trace, TraceRequest

pytestmark = pytest.mark.unit

OLD = Path(__file__).parent / "data" / "compare-before-repeats"  # an old run, cut short


def _requests(n: int = 10) -> list[RequestResult]:
    return [RequestResult(id=str(i), cls="chat" if i % 2 else "long", prompt_len=10 + i,
                          max_tokens=5, scheduled_s=0.5 * i, start_s=0.5 * i + 0.01,
                          status=OK if i != 3 else REJECTED,
                          ttft_s=0.1 * (i + 1) if i != 3 else None,
                          e2e_s=0.1 * (i + 1) + 0.2 if i != 3 else None,
                          itls_s=[0.05] * 4 if i != 3 else [], output_tokens=5 if i != 3 else 0)
            for i in range(n)]


def _run(load: Load | None = None) -> RunResult:
    load = load or Load(rate=2.0, burst=Burst(3.0, 2.0, 1.0))
    trace = Trace([TraceRequest(max_tokens=5, prompt="x")], {"tokenizer": "t"}, "ab" * 32)
    return RunResult.of(_requests(), 6.0, load, trace, Slo.parse("ttft_p95=0.5"), "cfg @2/s",
                        [{"t": 0.0, "client_in_flight": 1.0, "running": 1.0}],
                        Origin("2026-01-01T00:00:00+00:00", backend="openai-completions"),
                        metrics=ServerFigures(metrics_source="loom", preemptions=2),
                        client=ClientFigures(send_lag_p95_ms=3.0, limited_reasons=[]))


def test_a_run_round_trips_through_its_json(tmp_path: Path) -> None:
    run = _run()
    save_json(run, tmp_path / "run.json")
    text = (tmp_path / "run.json").read_text()
    back = load_result(tmp_path / "run.json")
    assert isinstance(back, RunResult) and back == run
    assert json.loads(text) == run.to_json()
    assert back.load.burst == Burst(3.0, 2.0, 1.0) and back.origin.date.startswith("2026")


def test_a_run_reads_by_the_keys_of_its_file() -> None:
    run = _run()
    figures = request_figures(run.requests, run.duration, Slo.parse("ttft_p95=0.5"))
    assert run["p95_ttft_ms"] == run.figures.ttft.p95 == figures.ttft.p95
    assert run["completed"] == 9 and run["rejected"] == 1 and run["request_rate"] == 2.0
    assert run["goodput"]["good"] == figures.goodput.good
    assert run["burst"] == {"factor": 3.0, "length_s": 2.0, "start_s": 1.0, "end_s": 3.0}
    assert run["per_class"]["chat"]["completed"] == 4  # of 5: one refused
    assert run["preemptions"] == 2
    assert run["requests"][0]["class"] == "long"
    with pytest.raises(TypeError):  # a result is built once, never edited
        run["completed"] = 3  # type: ignore[index]


def test_an_unlimited_load_is_written_as_inf_and_read_back() -> None:
    run = _run(Load(max_concurrency=4))
    assert run.to_json()["request_rate"] == "inf" and run.closed_loop
    assert RunResult.from_json(run.to_json()).load.rate == math.inf


def test_a_committed_comparison_reads_with_its_figures() -> None:
    result = load_result(OLD)
    assert isinstance(result, CompareResult)
    for entry, sweep in zip(result.configs, result.sweeps):
        raw = json.loads((OLD / entry.file).read_text())
        assert sweep.label == raw["label"] and len(sweep.runs) == len(raw["runs"])
        for run, obj in zip(sweep.runs, raw["runs"]):
            assert run.figures.ttft.p95 == obj["p95_ttft_ms"]
            assert run.metrics.kv_cache_usage.peak == obj["kv_cache_usage_peak"]
            assert run.max_concurrency == obj["max_concurrency"]
            # written again, every key keeps its value; what the file predates is added
            again = run.to_json()
            kept = [k for k in obj if k not in ("client", "per_class", "requests")]
            assert {k: again[k] for k in kept} == {k: obj[k] for k in kept}
            assert again["client"].items() >= obj["client"].items()


def test_a_sweep_takes_exactly_one_kind_of_point_and_runs_rates_in_order() -> None:
    with pytest.raises(ValueError, match="exactly one of --rates, --overlap or --auto"):
        SweepSpec(rates=[1.0], concurrencies=[2])
    with pytest.raises(ValueError, match="exactly one"):
        SweepSpec()
    spec = SweepSpec(Load(seed=3), rates=[4.0, 1.0, 4.0])
    assert spec.rates == [1.0, 4.0] and [x.rate for x in spec.loads()] == [1.0, 4.0]
    users = SweepSpec(concurrencies=[2, 8]).loads()
    assert [(x.rate, x.max_concurrency) for x in users] == [(math.inf, 2), (math.inf, 8)]


@dataclass
class StandIn:
    """A Measure whose sweeps are made up, recording what it was asked."""

    flags: str
    repeatable: bool = True
    refuse: bool = False
    calls: list[str] = field(default_factory=list)

    def check(self, name: str, spec: SweepSpec) -> None:
        self.calls.append(f"check {name}")
        if self.refuse:
            raise ValueError(f"{name} cannot be measured")

    def sweep(self, name: str, trace: Trace, spec: SweepSpec, log: Path) -> SweepResult:
        self.calls.append(f"sweep {name} {log.name}")
        runs = [replace(_run(load), label=f"{name} {load.point_name}") for load in spec.loads()]
        return SweepResult(name, runs, limits=spec.limits)


def test_compare_checks_all_then_interleaves_repeats_and_measures_the_rest_once(
        tmp_path: Path) -> None:
    a, b = StandIn("--a"), StandIn("simulate:--b", repeatable=False)
    trace = Trace([TraceRequest(max_tokens=5, prompt="x")], {}, "cd" * 32)
    result = compare(trace, [("a", a), ("b", b)], SweepSpec(Load(), Limits(), rates=[1.0]),
                     tmp_path, repeats=2)
    assert a.calls == ["check a", "sweep a a.repeat1.server.log", "sweep a a.repeat2.server.log"]
    assert b.calls == ["check b", "sweep b b.repeat1.server.log"]
    assert [s.repeats for s in result.sweeps] == [2, 1]
    assert [e.name for e in load_result(tmp_path).configs] == ["a", "b"]
    assert (tmp_path / "scorecard.md").exists()


def test_compare_refuses_before_any_configuration_runs(tmp_path: Path) -> None:
    a, b = StandIn("--a"), StandIn("--b", refuse=True)
    with pytest.raises(ValueError, match="b cannot be measured"):
        compare(Trace([TraceRequest(max_tokens=1, prompt="x")]), [("a", a), ("b", b)],
                SweepSpec(rates=[1.0]), tmp_path)
    assert a.calls == ["check a"]
