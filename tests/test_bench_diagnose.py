"""`loom diagnose`: each of its rules fires on a crafted result that shows its pattern,
and none fires on a healthy one."""

from __future__ import annotations

import json

import pytest

from loom.bench.diagnose import bound, diagnose, what_bounds
from loom.bench.scrape import Histogram, Snapshot, server_figures
from loom.cli.main import main
from loom.workload.figures import per_class, request_figures
from loom.workload.monitoring import client_figures
from loom.workload.requests import OK, RequestResult
from loom.workload.results import load_result, save_json

pytestmark = pytest.mark.unit


def _requests(n: int = 20, short_ttft: float = 0.1, long_ttft: float = 0.3,
              lag: float = 0.0) -> list[RequestResult]:
    """Alternating short (30-token) and long (800-token) prompts, 20 output tokens each."""
    out = []
    for i in range(n):
        long = i % 2 == 1
        ttft = long_ttft if long else short_ttft
        out.append(RequestResult(
            id=str(i), cls="long" if long else "chat", prompt_len=800 if long else 30,
            max_tokens=20, scheduled_s=0.5 * i, start_s=0.5 * i + lag, status=OK,
            ttft_s=ttft, e2e_s=ttft + 19 * 0.05, itls_s=[0.05] * 19, output_tokens=20))
    return out


def _timeline(running: list[float], waiting: float = 0.0, kv: float = 0.3,
              in_flight: list[float] | None = None) -> list[dict]:
    in_flight = in_flight or [r + waiting for r in running]
    return [{"t": float(i), "running": r, "waiting": waiting, "kv_usage": kv,
             "client_in_flight": f, "preemptions": 0} for i, (r, f) in
            enumerate(zip(running, in_flight))]


def make_run(requests: list[RequestResult] | None = None, timeline: list[dict] | None = None,
             rate: float | str = 2.0, preemptions: int = 0, server_ttft_s: float | None = None,
             label: str = "run", **overrides) -> dict:
    """A run result as `loom bench run` writes it; healthy unless told otherwise."""
    requests = requests if requests is not None else _requests()
    timeline = timeline if timeline is not None else _timeline([1, 2, 3, 2, 1])
    duration = 10.0
    after = Snapshot(counters={"preemptions": preemptions}, source="loom")
    if server_ttft_s is not None:
        after.histograms["ttft"] = Histogram({server_ttft_s: 20, float("inf"): 20},
                                             20 * server_ttft_s, 20)
    run = {"kind": "run", "label": label, "request_rate": rate, "max_concurrency": None,
           "offered_rate": 2.0, "duration": duration, "server": {}, "slo": None,
           "errors": [], "timeline": timeline, "requests": [r.to_json() for r in requests],
           "trace": {"sha256": "0" * 64}}
    run.update(request_figures(requests, duration, None))
    run.update(server_figures(None, after, timeline))
    run["client"] = client_figures(requests, timeline,
                                   closed_loop=overrides.get("max_concurrency") is not None)
    run["per_class"] = per_class(requests, duration, None)
    run.update(overrides)
    return run


def sweep_of(*runs: dict, label: str = "cfg", flags: str = "") -> dict:
    return {"kind": "sweep", "label": label, "runs": list(runs), "config": {"flags": flags}}


def rules(obj: dict) -> list[str]:
    return [f.rule for f in diagnose(obj)]


def test_healthy_run_and_sweep_are_quiet(tmp_path) -> None:
    assert rules(make_run()) == []
    healthy_sweep = sweep_of(make_run(rate=1.0, label="@1"), make_run(rate=2.0, label="@2"))
    assert rules(healthy_sweep) == []
    path = tmp_path / "run.json"
    save_json(make_run(), path)
    assert main(["diagnose", str(path), "--json"]) == 0


def test_waiting_at_the_sequence_cap_with_free_memory() -> None:
    run = make_run(timeline=_timeline([4, 4, 4, 4, 4], waiting=3, kv=0.35),
                   server={"cmdline": ["loom", "serve", "--max-num-seqs", "4"]})
    (finding,) = diagnose(run)
    assert finding.rule == "waiting_memory_free"
    assert finding.setting.startswith("--max-num-seqs")
    assert "waiting averaged 3.0" in finding.message and "35%" in finding.message
    assert "max_num_seqs 4" in finding.message


def test_waiting_below_any_cap_points_at_the_token_budget() -> None:
    run = make_run(timeline=_timeline([1, 3, 2, 5, 2], waiting=2, kv=0.2))
    (finding,) = diagnose(run)
    assert finding.rule == "waiting_memory_free"
    assert finding.setting == "--max-num-batched-tokens"


def test_waiting_behind_a_static_batch_points_at_continuous_batching() -> None:
    run = make_run(timeline=_timeline([1, 3, 2, 5, 2], waiting=2, kv=0.2),
                   server={"cmdline": ["loom", "serve", "--scheduler", "static"]})
    (finding,) = diagnose(run)
    assert finding.rule == "waiting_memory_free"
    assert finding.setting == "--scheduler continuous"
    assert "batches statically" in finding.message


def test_rejections_with_free_memory_point_at_admission() -> None:
    requests = _requests()
    for r in requests[:5]:
        r.status, r.http_status, r.ttft_s, r.e2e_s = "rejected", 503, None, None
    (finding,) = diagnose(make_run(requests))
    assert finding.rule == "waiting_memory_free"
    assert "5 of 20 requests got 503" in finding.message
    assert finding.setting.startswith("--max-num-queued-reqs")


def test_client_side_concurrency_holds_requests() -> None:
    run = make_run(_requests(lag=1.2), max_concurrency=2)
    (finding,) = diagnose(run)
    assert finding.rule == "client_concurrency"
    assert "p95 send lag 1.20 s" in finding.message
    assert "--max-concurrency" in finding.setting


def test_ttft_rises_with_long_prompts() -> None:
    run = make_run(_requests(short_ttft=0.2, long_ttft=3.5))
    (finding,) = diagnose(run)
    assert finding.rule == "ttft_long_prompts"
    assert finding.setting == "--max-num-batched-tokens"
    assert "p95 3.50 s" in finding.message and "p95 0.20 s" in finding.message
    no_chunking = make_run(_requests(short_ttft=0.2, long_ttft=3.5),
                           server={"cmdline": ["serve", "--no-enable-chunked-prefill"]})
    assert diagnose(no_chunking)[0].setting == "--enable-chunked-prefill"


def test_long_prompts_within_the_limit_are_fine() -> None:
    assert rules(make_run(_requests(short_ttft=0.1, long_ttft=0.9))) == []


def test_throughput_up_p95_worse_along_a_sweep() -> None:
    low = make_run(rate=2.0, label="@2")
    high = make_run(_requests(short_ttft=6.0, long_ttft=6.0), rate=4.0, label="@4",
                    request_throughput=low["request_throughput"] * 1.05)
    findings = [f for f in diagnose(sweep_of(low, high)) if f.rule == "throughput_up_p95_worse"]
    assert len(findings) == 1
    assert "rose only 5%" in findings[0].message and "p95 TTFT grew" in findings[0].message


def test_throughput_up_p95_worse_between_configurations(tmp_path) -> None:
    base = make_run(rate=2.0, label="a @2")
    eager = make_run(_requests(short_ttft=0.2, long_ttft=0.6), rate=2.0, label="b @2",
                     request_throughput=base["request_throughput"] * 1.2)
    save_json(sweep_of(base, label="a"), tmp_path / "a.json")
    save_json(sweep_of(eager, label="b"), tmp_path / "b.json")
    save_json({"kind": "compare", "configs": [{"name": "a", "file": "a.json"},
                                              {"name": "b", "file": "b.json"}]},
              tmp_path / "compare.json")
    findings = diagnose(load_result(tmp_path))  # a compare directory
    assert [f.rule for f in findings] == ["throughput_up_p95_worse"]
    assert findings[0].run == "a vs b" and "+20%" in findings[0].message


def test_preemptions_and_oom() -> None:
    (finding,) = diagnose(make_run(preemptions=6))
    assert finding.rule == "preemptions_kv_pressure"
    assert "6 preemptions for 20 requests" in finding.message
    assert finding.setting == "--kv-cache-memory"
    oom = make_run(errors=["stream error: CUDA out of memory"])
    assert rules(oom) == ["preemptions_kv_pressure"]


def test_requests_in_flight_that_the_engine_never_sees() -> None:
    run = make_run(timeline=_timeline([1, 1, 1, 1], in_flight=[6, 7, 6, 7]))
    (finding,) = diagnose(run)
    assert finding.rule == "upstream_bottleneck"
    assert "6.5 requests in flight" in finding.message
    assert finding.setting.startswith("--num-threads")


def test_ttft_spent_outside_the_engine() -> None:
    (finding,) = diagnose(make_run(server_ttft_s=0.01))
    assert finding.rule == "upstream_bottleneck"
    assert "inside the engine" in finding.message


def test_late_load_generator() -> None:
    (finding,) = diagnose(make_run(_requests(lag=0.8)))
    assert finding.rule == "client_limited"
    assert "the client, not the server, limited this run" in finding.message
    assert finding.setting.startswith("the load generator")


def test_cli_prints_findings_as_json(tmp_path, capsys) -> None:
    path = tmp_path / "run.json"
    save_json(make_run(preemptions=6), path)
    assert main(["diagnose", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (finding,) = out["findings"]
    assert finding["rule"] == "preemptions_kv_pressure" and finding["evidence"]["preemptions"] == 6
    assert out["what_bounds"][0].startswith("run: ")


def test_a_quiet_diagnosis_still_says_what_bounds_each_run(tmp_path, capsys) -> None:
    """Queue empty and TTFT long (two rules just under their thresholds): prefill-bound."""
    run = make_run(requests=_requests(short_ttft=1.2, long_ttft=1.9), label="continuous")
    assert rules(run) == []
    assert bound(run).startswith("continuous: prefill-bound") and "queue 0%" in bound(run)
    path = tmp_path / "run.json"
    save_json(run, path)
    assert main(["diagnose", str(path)]) == 0
    out = capsys.readouterr().out
    assert "No rule fired" in out and "continuous: prefill-bound" in out
    decode_bound = make_run(requests=_requests(short_ttft=0.1, long_ttft=0.1))
    assert "decode-bound" in what_bounds(sweep_of(decode_bound))[0]


def test_a_simulated_run_says_so_in_findings() -> None:
    (finding,) = diagnose(make_run(preemptions=6, simulated=True, label="sim"))
    assert finding.run == "sim (simulated)"


def test_waiting_with_a_full_kv_cache_at_the_sequence_cap() -> None:
    """A what-if of a GPU too small for the load: the cache full, the batch at max_num_seqs,
    a long queue and no preemption. That is memory bounding the batch, not a quiet run."""
    run = make_run(timeline=_timeline([128, 128, 128], waiting=98, kv=0.996),
                   server={"cmdline": ["loom", "serve", "--max-num-seqs", "128"]})
    (finding,) = diagnose(run)
    assert finding.rule == "kv_cache_full"
    assert "99.6%" in finding.message and "= max_num_seqs 128" in finding.message
    assert finding.setting.startswith("--kv-cache-memory")


def test_waiting_at_the_sequence_cap_with_memory_in_use() -> None:
    """KV cache 85% full (not free, not full) and running at the cap: the cap bounds it."""
    run = make_run(timeline=_timeline([8, 8, 8], waiting=3, kv=0.85))
    (finding,) = diagnose(sweep_of(run, flags="--max-num-seqs 8"))
    assert finding.rule == "batch_at_cap" and "= max_num_seqs 8" in finding.message
    assert finding.setting.startswith("--max-num-seqs")


def test_failed_requests_say_what_the_errors_were(tmp_path, capsys) -> None:
    requests = _requests()
    for r in requests[:5]:
        r.status, r.http_status, r.ttft_s, r.e2e_s = "error", 400, None, None
        r.error = "HTTP 400: prompt longer than max_model_len"
    (finding,) = diagnose(make_run(requests))
    assert finding.rule == "failed_requests"
    assert "5 of 20 requests failed (25%): 5 x HTTP 400: prompt longer" in finding.message
    assert "--max-model-len" in finding.setting


def test_json_says_what_bounds_each_run_when_no_rule_fires(tmp_path, capsys) -> None:
    path = tmp_path / "run.json"
    save_json(make_run(label="quiet"), path)
    assert main(["diagnose", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["findings"] == [] and out["what_bounds"][0].startswith("quiet: ")
