"""Repeats, bursts, fairness and the checklist on synthetic results (pure functions)."""

from __future__ import annotations

import random

import pytest

from loom.bench.checklist import FAIL, NOT_MEASURED, PASS, answer
from loom.bench.fairness import fairness, jain
from loom.bench.overload import burst_outcomes, recovery_s
from loom.bench.repeats import aggregate, bootstrap_ci, differences, merge_sweeps
from loom.bench.scorecard import markdown
from loom.workload.arrivals import Burst, RampUp, schedule, time_warp
from loom.workload.figures import per_class, request_figures
from loom.workload.monitoring import client_figures
from loom.workload.requests import OK, REJECTED, TIMEOUT, RequestResult
from loom.workload.slo import Slo
from loom.workload.trace import TraceRequest

pytestmark = pytest.mark.unit


def _request(i: int, ttft: float, cls: str = "chat", status: str = OK, prompt: int = 40,
             tokens: int = 10, tpot: float = 0.05, at: float | None = None,
             tenant: str | None = None) -> RequestResult:
    done = status == OK
    return RequestResult(
        id=str(i), cls=cls, prompt_len=prompt, max_tokens=tokens,
        scheduled_s=at if at is not None else 0.1 * i, start_s=at if at is not None else 0.1 * i,
        status=status, ttft_s=ttft if done else None,
        e2e_s=ttft + (tokens - 1) * tpot if done else None,
        itls_s=[tpot] * (tokens - 1) if done else [], output_tokens=tokens if done else 0,
        tenant=tenant)


def _run(requests: list[RequestResult], label: str = "cfg @1/s", duration: float = 10.0,
         **extra) -> dict:
    run = {"kind": "run", "label": label, "request_rate": 1.0, "max_concurrency": None,
           "offered_rate": 1.0, "duration": duration, "slo": None, "errors": [],
           "timeline": [], "requests": [r.to_json() for r in requests],
           "trace": {"sha256": "0" * 64}, "preemptions": 0, "kv_cache_usage_peak": 0.3}
    run.update(request_figures(requests, duration, None))
    run["client"] = client_figures(requests, [])
    run["per_class"] = per_class(requests, duration, None)
    run.update(extra)
    return run


def _noisy_runs(k: int, mean_ttft: float, seed: int, label: str = "cfg @1/s") -> list[dict]:
    """k repeats whose TTFT (and so throughput) varies from repeat to repeat."""
    rng = random.Random(seed)
    runs = []
    for _ in range(k):
        level = rng.gauss(mean_ttft, 0.1 * mean_ttft)
        requests = [_request(i, level * rng.uniform(0.95, 1.05)) for i in range(20)]
        runs.append(_run(requests, label, duration=rng.gauss(10.0, 1.0)))
    return runs


def test_ci_width_shrinks_with_repeats() -> None:
    rng = random.Random(1)
    population = [rng.gauss(100, 10) for _ in range(400)]
    widths = []
    for k in (3, 10, 40):
        lows, highs = zip(*(bootstrap_ci(rng.sample(population, k), seed=s) for s in range(5)))
        widths.append(sum(h - lo for lo, h in zip(lows, highs)) / 5)
    assert widths[0] > widths[1] > widths[2]
    assert bootstrap_ci([5.0, 5.0, 5.0]) == (5.0, 5.0)


def test_aggregate_reports_medians_and_intervals() -> None:
    runs = _noisy_runs(5, 0.5, seed=2)
    merged = aggregate(runs)
    assert merged["repeats"] == 5 and len(merged["repeat_figures"]) == 5
    assert merged["num_prompts"] == 100 and len(merged["requests"]) == 100
    values = sorted(r["p95_ttft_ms"] for r in runs)
    assert merged["p95_ttft_ms"] == values[2]  # the median of five
    low, high = merged["ci"]["p95_ttft_ms"]
    assert values[0] <= low <= merged["p95_ttft_ms"] <= high <= values[-1]
    table = markdown([merged])
    assert f"[{low / 1000:.2f}-{high / 1000:.2f}]" in table  # the interval in the cell


def test_identical_configurations_differ_only_by_noise() -> None:
    """Two configurations drawn from the same distribution: every figure's difference is
    inside the noise; a configuration twice as slow is not."""
    a = merge_sweeps([{"kind": "sweep", "label": "a", "runs": [r], "knee_rate": None}
                      for r in _noisy_runs(6, 0.5, seed=3, label="a @1/s")])
    b = merge_sweeps([{"kind": "sweep", "label": "b", "runs": [r], "knee_rate": None}
                      for r in _noisy_runs(6, 0.5, seed=4, label="b @1/s")])
    slow = merge_sweeps([{"kind": "sweep", "label": "slow", "runs": [r], "knee_rate": None}
                         for r in _noisy_runs(6, 1.0, seed=5, label="slow @1/s")])
    same = differences([("a", a["runs"]), ("b", b["runs"])])
    assert same and {d["verdict"] for d in same if d["figure"] == "p95_ttft_ms"} == {"noise"}
    other = differences([("a", a["runs"]), ("slow", slow["runs"])])
    assert {d["verdict"] for d in other if d["figure"] == "p95_ttft_ms"} == {"worse"}
    groups = [("a", a["runs"]), ("b", b["runs"])]
    assert "inside the noise" in markdown(a["runs"] + b["runs"], groups=groups)


def test_burst_and_ramp_shape_the_arrivals() -> None:
    requests = [TraceRequest(max_tokens=1, prompt="x", id=str(i)) for i in range(400)]
    burst = Burst.parse("4x:5s@5s")
    times = [t for t, _ in schedule(requests, 4.0, burst=burst)]
    inside = sum(5 <= t < 10 for t in times)
    before = sum(t < 5 for t in times)
    assert inside > 2.5 * before  # ~4x the rate while it lasts
    plain = [t for t, _ in schedule(requests, 4.0)]
    assert [round(t, 6) for t in times if t < 5] == [round(t, 6) for t in plain if t < 5]
    ramped = [t for t, _ in schedule(requests, 4.0, ramp=RampUp.parse("linear:20s"))]
    assert sum(t < 10 for t in ramped) < sum(10 <= t < 20 for t in ramped)
    assert time_warp(None, RampUp(10))(5.0) == pytest.approx(10.0)  # half the ramp's area
    with pytest.raises(ValueError, match="finite"):
        next(schedule(requests, float("inf"), burst=burst))


def test_burst_outcomes_and_recovery() -> None:
    requests = [_request(i, 0.2, at=i * 0.5) for i in range(10)]                 # before
    requests += [_request(10 + i, 1.5, at=5 + i * 0.1, cls="long" if i % 2 else "chat")
                 for i in range(20)]                                             # during
    requests += [_request(30, 0, status=REJECTED, at=6.0), _request(31, 0, status=TIMEOUT,
                                                                    at=6.1)]
    requests += [_request(40 + i, 1.2 if i < 3 else 0.25, at=7 + i * 0.5) for i in range(8)]
    run = _run(requests, burst={"factor": 5, "length_s": 2, "start_s": 5, "end_s": 7})
    o = burst_outcomes(run, Slo.parse("ttft_p95=1,e2e_p95=10"))
    assert o["during"]["sent"] == 22 and o["during"]["rejected"] == 1
    assert o["during"]["timeouts"] == 1 and o["response"] == "rejection"
    assert o["goodput_during"] == 0.0  # every answer in the burst was over 1 s TTFT
    assert o["recovery_s"] == pytest.approx(1.5)  # the fourth request after it is normal
    assert recovery_s([_request(1, 5.0, at=8)], 200.0, 7.0) is None  # never recovered
    assert burst_outcomes(_run(requests)) is None


def test_jain_index_and_slowdowns() -> None:
    assert jain([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    fair = [_request(i, 0.1 if i % 2 else 1.0, cls="chat" if i % 2 else "long",
                     prompt=40 if i % 2 else 400, tenant="t1" if i % 3 else "t2")
            for i in range(40)]
    f = fairness(fair)
    assert f["jain_class"] == pytest.approx(1.0, abs=0.01)  # same slowdown once normalised
    unfair = fair + [_request(100 + i, 3.0, cls="chat", prompt=40) for i in range(20)]
    g = fairness(unfair)
    assert g["by_class"]["chat"]["mean_slowdown"] > g["by_class"]["long"]["mean_slowdown"]
    assert g["jain_class"] < f["jain_class"]
    assert set(f["by_tenant"]) == {"t1", "t2"}


def test_checklist_answers_pass_fail_not_measured() -> None:
    fast = aggregate(_noisy_runs(3, 0.3, seed=6, label="fast @1/s"))
    slow = aggregate(_noisy_runs(3, 3.0, seed=7, label="slow @1/s"))
    chosen, answers = answer([("fast", [fast], ""), ("slow", [slow], "")],
                             slo=Slo.parse("ttft_p95=1,e2e_p95=10"))
    status = {a.key: a.status for a in answers}
    assert chosen == "fast"
    assert status == {"latency": PASS, "burst": NOT_MEASURED, "memory": PASS,
                      "reproducibility": status["reproducibility"], "cost": PASS}
    assert status["reproducibility"] in (PASS, FAIL)
    _, answers = answer([("fast", [fast], ""), ("slow", [slow], "")], main="slow",
                        slo=Slo.parse("ttft_p95=1,e2e_p95=10"))
    assert answers[0].status == FAIL and "p95 TTFT" in answers[0].numbers
    _, answers = answer([("only", [_run([_request(0, 0.1)])], "")])
    assert [a.status for a in answers] == [NOT_MEASURED, NOT_MEASURED, PASS, NOT_MEASURED,
                                           NOT_MEASURED]
