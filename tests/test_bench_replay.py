"""`loom bench run | sweep | compare` against an independent fake OpenAI server whose timing is
known: the client's own TTFT / ITL / throughput math is checked against that truth."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
from pathlib import Path

import httpx
import pytest
from bench_helpers import write_trace_file
from fake_openai_server import running_fake_server

from loom.bench.replay import Target, replay
from loom.bench.scrape import sample_value
from loom.bench.sweep import sweep
from loom.cli.main import main
from loom.workload.load import Load
from loom.workload.results import Limits, load_result
from loom.workload.trace import Trace, TraceRequest

pytestmark = pytest.mark.integration

TTFT, ITL, TOKENS = 0.5, 0.05, 12  # long enough to stay measurable on a loaded 2-core box
FAKE = str(Path(__file__).parent / "fake_openai_server.py")
CLASSES = ["chat", "rag", "chat", "long"]


@pytest.fixture(scope="module")
def fake_url():
    with running_fake_server("--ttft", str(TTFT), "--itl", str(ITL)) as url:
        yield url


@pytest.fixture(scope="module")
def busy_url():
    """A fake that refuses (503) any request beyond 2 in flight."""
    with running_fake_server("--ttft", "0.3", "--itl", "0.02", "--max-running", "2") as url:
        yield url


def _trace(n: int, max_tokens: int = TOKENS, **extra) -> Trace:
    return Trace([TraceRequest(max_tokens=max_tokens, prompt="a b c", id=str(i),
                               cls="even" if i % 2 == 0 else "odd", **extra) for i in range(n)])


def _replay(trace: Trace, load: Load, url: str, model: str | None = None) -> dict:
    return asyncio.run(replay(trace, load, Target(url, model, scrape_interval_s=0.2),
                              progress=False))


def test_timing_is_measured_from_the_client_side(fake_url: str) -> None:
    """The fake server sends each token at a fixed time after the request arrives, so the
    client never sees the first or the last one sooner: TTFT and E2E are at least the
    server's, and the figures agree with each other. (How much later depends on the
    machine's load, so no upper bound is asserted.)"""
    result = _replay(_trace(8), Load(max_concurrency=4), fake_url)
    assert result["completed"] == 8 and result["failed"] == 0
    e2e = TTFT + (TOKENS - 1) * ITL
    for r in result["requests"]:
        assert r["ttft_s"] >= TTFT and r["e2e_s"] >= e2e
        assert len(r["itls_s"]) == TOKENS - 1 and r["output_tokens"] == TOKENS
        # the last token arrives before the stream ends (usage chunk, [DONE]): no later
        assert r["ttft_s"] + sum(r["itls_s"]) <= r["e2e_s"]
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (TOKENS - 1))
    assert result["median_ttft_ms"] >= 1000 * TTFT
    itls = [gap for r in result["requests"] for gap in r["itls_s"]]
    assert result["mean_itl_ms"] == pytest.approx(1000 * sum(itls) / len(itls))
    assert result["duration"] >= 2 * e2e  # 8 requests, 4 users: two rounds at least
    assert result["output_throughput"] == pytest.approx(8 * TOKENS / result["duration"])
    assert result["request_throughput"] == pytest.approx(8 / result["duration"])
    assert result["total_output_tokens"] == 8 * TOKENS
    # the closed loop never had more than 4 in flight, and the server's gauges were read
    assert result["client"]["in_flight_peak"] == 4
    assert result["num_requests_running_peak"] <= 4
    assert result["metrics_source"] == "loom" and result["preemptions"] == 0
    assert set(result["per_class"]) == {"even", "odd"}


def test_open_loop_sends_on_schedule(fake_url: str) -> None:
    result = _replay(_trace(10, max_tokens=2), Load(rate=20.0, seed=3), fake_url)
    scheduled = [r["scheduled_s"] for r in result["requests"]]
    assert scheduled == sorted(scheduled) and scheduled[0] == 0.0 and scheduled[-1] > 0
    assert all(r["start_s"] >= r["scheduled_s"] for r in result["requests"])  # never early
    assert result["client"]["send_lag_p95_ms"] >= 0
    assert result["request_rate"] == 20.0 and result["completed"] == 10


def test_cancellation_closes_the_stream_and_is_counted(fake_url: str) -> None:
    trace = _trace(2, max_tokens=40)
    trace.requests[0].cancel_after_s = 0.6  # after the first token, long before the last
    result = _replay(trace, Load(), fake_url)
    cancelled, done = result["requests"]
    assert cancelled["status"] == "cancelled" and done["status"] == "ok"
    assert (result["cancelled"], result["completed"], result["failed"]) == (1, 1, 0)
    assert 0 < cancelled["output_tokens"] < 40
    assert cancelled["e2e_s"] >= 0.6 and cancelled["e2e_s"] < done["e2e_s"]
    metrics = httpx.get(fake_url + "/metrics").text  # the server saw the client leave
    assert sample_value(metrics, "loom:num_requests_running") == 0


def test_503s_are_counted_not_dropped(busy_url: str) -> None:
    result = _replay(_trace(6), Load(), busy_url)
    assert result["num_prompts"] == 6
    assert (result["completed"], result["rejected"], result["failed"]) == (2, 4, 4)
    assert result["error_rate"] == pytest.approx(4 / 6)
    assert result["server_rejected"] == 4
    rejected = [r for r in result["requests"] if r["status"] == "rejected"]
    assert all(r["http_status"] == 503 and r["retry_after"] == "1" for r in rejected)


def test_connection_errors_are_counted() -> None:
    from loom.bench.server import free_port

    result = _replay(_trace(3), Load(), f"http://127.0.0.1:{free_port()}", model="m")
    assert (result["failed"], result["completed"]) == (3, 0)
    assert result["metrics_source"] is None
    assert all(r["status"] == "error" for r in result["requests"])


def test_cli_run_writes_vllm_compatible_json(fake_url: str, tmp_path) -> None:
    trace = write_trace_file(tmp_path / "t.jsonl", ["hi"] * 4, 3, CLASSES)
    out = tmp_path / "run.json"
    assert main(["bench", "run", "--base-url", fake_url + "/v1", "--trace", str(trace),
                 "--max-concurrency", "2", "--slo", "ttft_p95=1,e2e_p95=5",
                 "--gpu-cost-per-hour", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    vllm_keys = {"completed", "failed", "request_throughput", "output_throughput",
                 "total_token_throughput", "total_input_tokens", "total_output_tokens",
                 "duration", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                 "model_id", "request_goodput", "date"}
    vllm_keys |= {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p95", "p99")
                  for m in ("ttft", "tpot", "itl", "e2el")}
    loom_keys = {"rejected", "cancelled", "queue_time", "preemptions", "per_class", "goodput",
                 "command", "server", "trace", "hardware", "timeline", "requests", "error_rate"}
    assert vllm_keys | loom_keys <= set(result)
    assert result["model_id"] == "fake-model"
    assert result["server"]["version"]["version"] == "fake-1.0"
    assert len(result["trace"]["sha256"]) == 64
    assert result["hardware"]["cpu_count"] >= 1
    assert result["goodput"]["good"] == 4 and result["goodput"]["slo_met"] is True
    assert result["queue_time"]["count"] >= 4
    assert result["command"]  # sys.argv of the process: here pytest's


def test_sweep_stops_at_the_limit(busy_url: str) -> None:
    """Rates run in ascending order whatever order they were given in, so the knee is the
    highest rate within the limits; nothing runs after the first rate beyond them."""
    result = asyncio.run(sweep(_trace(4, max_tokens=4), Load(), Target(busy_url), Limits(),
                               rates=[math.inf, 2.0, 100.0], progress=False))
    assert [r["request_rate"] for r in result["runs"]] == [2.0, 100.0]  # inf never ran
    assert result["knee_rate"] == 2.0
    assert "error rate" in result["runs"][1]["limits_crossed"][0]


def test_bench_compare_is_also_spelled_as_a_flag(capsys) -> None:
    """`loom bench --compare ...` is the same command as `loom bench compare ...`."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "WARNING", "bench", "--compare", "--help"])
    assert exit_info.value.code == 0
    assert "usage: loom bench compare" in capsys.readouterr().out


def test_compare_starts_each_server_and_writes_the_report(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="loom.bench.server")
    trace = write_trace_file(tmp_path / "t.jsonl", ["hi"] * 4, 4, CLASSES)
    out = tmp_path / "cmp"
    assert main(["bench", "compare", "--trace", str(trace), "--overlap", "1,2",
                 "--output-dir", str(out), "--scrape-interval", "0.2",
                 "--server-cmd", f"{sys.executable} {FAKE} --port {{port}} --ttft 0.05",
                 "--config", "fast=--itl 0.01", "--config", "slow=--itl 0.03"]) == 0
    started = [r.getMessage() for r in caplog.records if r.name == "loom.bench.server"]
    assert sum(m.startswith("starting ") for m in started) == 2  # said while each starts
    assert sum("healthy after" in m for m in started) == 2
    names = {p.name for p in out.iterdir()}
    assert {"compare.json", "fast.json", "slow.json", "scorecard.md", "throughput.png",
            "latency.png", "timeline-fast.png", "timeline-slow.png"} <= names
    result = load_result(out)
    assert [s["config"]["flags"] for s in result["sweeps"]] == ["--itl 0.01", "--itl 0.03"]
    assert [r["max_concurrency"] for r in result["sweeps"][0]["runs"]] == [1, 2]
    assert all(r["server_memory"]["peak_rss_bytes"] > 0 for s in result["sweeps"]
               for r in s["runs"])
    scorecard = (out / "scorecard.md").read_text()
    assert "| fast x1 | 1 users |" in scorecard and "## Per request class" in scorecard
    assert main(["diagnose", str(out)]) == 0
