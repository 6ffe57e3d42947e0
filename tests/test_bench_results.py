"""Result figures, /metrics parsing, SLOs and the scorecard (pure functions, no server)."""

from __future__ import annotations

import pytest

from loom.bench.scorecard import markdown, print_scorecard, rows
from loom.bench.scrape import Histogram, parse_metrics, sample_value
from loom.workload.figures import offered_rate, request_figures
from loom.workload.requests import CANCELLED, OK, REJECTED, RequestResult
from loom.workload.slo import Slo

pytestmark = pytest.mark.unit

LOOM_METRICS = """\
# TYPE loom:num_requests_running gauge
loom:num_requests_running{model_name="m"} 3.0
loom:num_requests_waiting{model_name="m"} 5.0
loom:kv_cache_usage_perc{model_name="m"} 0.42
loom:num_preemptions_total{model_name="m"} 7.0
loom:prefix_cache_queries_total{model_name="m"} 1000.0
loom:prefix_cache_hits_total{model_name="m"} 480.0
loom:request_queue_time_seconds_bucket{le="0.1",model_name="m"} 2.0
loom:request_queue_time_seconds_bucket{le="1.0",model_name="m"} 6.0
loom:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 8.0
loom:request_queue_time_seconds_sum{model_name="m"} 6.5
loom:request_queue_time_seconds_count{model_name="m"} 8.0
"""

VLLM_METRICS = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
"""


def _result(status: str, ttft: float | None = None, e2e: float | None = None,
            tokens: int = 0, prompt: int = 10) -> RequestResult:
    return RequestResult(id=None, cls="c", prompt_len=prompt, max_tokens=tokens, scheduled_s=0,
                         status=status, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens,
                         itls_s=[0.1] * max(tokens - 1, 0))


def test_parse_loom_metrics() -> None:
    snap = parse_metrics(LOOM_METRICS)
    assert snap.source == "loom"
    assert snap.gauges == {"running": 3.0, "waiting": 5.0, "kv_usage": 0.42}
    assert snap.counters["preemptions"] == 7.0
    assert snap.counters["prefix_cache_hits"] / snap.counters["prefix_cache_queries"] == 0.48
    queue = snap.histograms["queue_time"]
    assert (queue.count, queue.sum) == (8.0, 6.5)
    assert queue.quantile(0.5) == pytest.approx(0.1 + 0.9 * 2 / 4)  # inside (0.1, 1.0]
    assert queue.quantile(0.95) == 1.0  # beyond the last finite bucket: its bound


def test_one_sample_by_name_and_labels() -> None:
    assert sample_value(LOOM_METRICS, "loom:num_requests_waiting") == 5.0
    assert sample_value(VLLM_METRICS, "vllm:num_requests_running", engine="1") == 1.0
    assert sample_value(LOOM_METRICS, "loom:request_queue_time_seconds_bucket", le="1.0") == 6.0
    with pytest.raises(KeyError, match="loom:nothing"):
        sample_value(LOOM_METRICS, "loom:nothing")


def test_parse_vllm_metrics_sums_counts_and_takes_the_peak_kv() -> None:
    snap = parse_metrics(VLLM_METRICS)
    assert snap.source == "vllm"
    assert snap.gauges["running"] == 3.0 and snap.gauges["kv_usage"] == 0.7
    assert snap.counters["preemptions"] == 1.0


def test_histogram_delta_covers_only_the_run() -> None:
    before = Histogram({0.1: 2, 1.0: 2, float("inf"): 2}, 0.1, 2)
    after = Histogram({0.1: 2, 1.0: 6, float("inf"): 6}, 2.1, 6)
    delta = after.minus(before)
    assert delta.count == 4 and delta.summary()["mean_ms"] == pytest.approx(500)
    assert delta.quantile(1.0) == 1.0 and delta.quantile(0.0) == pytest.approx(0.1)


def test_request_figures_count_everything_once() -> None:
    results = [_result(OK, 0.5, 2.5, tokens=21), _result(OK, 1.5, 3.5, tokens=21),
               _result(REJECTED), _result("error"), _result(CANCELLED, 0.3, 1.0, tokens=3)]
    f = request_figures(results, duration_s=10.0, slo=Slo.parse("ttft_p95=1,e2e_p95=3"))
    assert (f["num_prompts"], f["completed"], f["failed"], f["rejected"], f["cancelled"]) == \
        (5, 2, 2, 1, 1)
    assert f["error_rate"] == pytest.approx(0.4)
    assert f["request_throughput"] == pytest.approx(0.2)
    assert f["output_throughput"] == pytest.approx(4.2)  # cancelled tokens are not output
    assert f["total_token_throughput"] == pytest.approx(6.2)
    assert f["median_ttft_ms"] == pytest.approx(1000) and f["mean_tpot_ms"] == pytest.approx(100)
    assert f["mean_itl_ms"] == pytest.approx(100) and f["p99_e2el_ms"] < 3500
    assert f["goodput"]["good"] == 1 and f["request_goodput"] == pytest.approx(0.1)
    assert f["goodput"]["slo_met"] is False  # p95 TTFT ~1.45 s > 1 s


def test_request_figures_of_nothing_completed() -> None:
    f = request_figures([_result(REJECTED)], duration_s=1.0, slo=None)
    assert f["completed"] == 0 and f["mean_ttft_ms"] is None and f["goodput"] is None


def test_a_short_run_never_completes_more_than_it_was_offered() -> None:
    """Two sends 2 s apart answered at once: 1 gap in 2 s of sending (0.5/s) but 2 answers
    in 2.05 s; offered is never below sent over the duration completed req/s uses."""
    sent = [_result(OK, 0.01, 0.05, tokens=2), _result(OK, 0.01, 0.05, tokens=2)]
    sent[1].scheduled_s = 2.0
    completed = request_figures(sent, 2.05, None)["request_throughput"]
    assert offered_rate(sent, 2.05) >= completed == pytest.approx(2 / 2.05)
    sent += [_result(OK, 0.01, 0.05, tokens=2) for _ in range(99)]
    for i, r in enumerate(sent):
        r.scheduled_s = 0.1 * i
    assert offered_rate(sent, 12.0) == pytest.approx(10.0)  # a long run: the send span's


def test_slo_parse() -> None:
    slo = Slo.parse("ttft_p95=1.0,e2e_p99=10,tpot=0.2")
    assert slo.limits == (("ttft", 95, 1.0), ("e2e", 99, 10.0), ("tpot", 95, 0.2))
    assert str(slo) == "ttft_p95=1,e2e_p99=10,tpot_p95=0.2"
    for bad in ("latency=3", "ttft_p95=-1", "ttft_p95=abc", "ttft_p0=1", "e2e_px=2"):
        with pytest.raises(ValueError, match="bad term"):
            Slo.parse(bad)


def _scored_run(**extra) -> dict:
    requests = [_result(OK, 0.5, 2.0, tokens=11), _result(OK, 2.0, 4.0, tokens=11)]
    return {"label": "continuous @1/s", "request_rate": 1.0, "max_concurrency": None,
            "offered_rate": 1.0, "duration": 3600.0, "preemptions": 2, "queue_time": None,
            "kv_cache_usage_peak": 0.5, "slo": None, "trace": {"sha256": "ab" * 32},
            "requests": [r.to_json() for r in requests],
            "per_class": {"c": {**request_figures(requests, 3600.0, None)}},
            **request_figures(requests, 3600.0, None), **extra}


def test_scorecard_reads_at_80_columns_and_wide_shows_all() -> None:
    from rich.console import Console

    run = _scored_run()
    narrow = Console(width=80, record=True)
    print_scorecard([run], Slo.parse("ttft_p95=1"), 3.0, console=narrow)
    text = narrow.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text and "--wide for all" in text
    assert "continuous @1/s" in text and "Goodput" in text and "KV peak" not in text
    wide = Console(width=80, record=True)
    print_scorecard([run], Slo.parse("ttft_p95=1"), 3.0, console=wide, wide=True)
    assert "KV" in wide.export_text()


def test_a_simulated_run_says_so() -> None:
    (row,) = rows([_scored_run(simulated=True)])
    assert row["Run"] == "continuous @1/s (simulated)"
    assert "(simulated)" in markdown([_scored_run(simulated=True)])


def test_scorecard_rows_goodput_and_cost() -> None:
    run = _scored_run()
    (row,) = rows([run], Slo.parse("ttft_p95=1"), gpu_cost_per_hour=3.0)
    assert row["Run"] == "continuous @1/s" and row["Preemptions"] == "2"
    assert row["p95 queue s"] == "-" and row["KV peak"] == "50%"
    assert row["Goodput req/s"] == "0.00" and row["SLO met"] == "no"
    assert row["$ / accepted answer"] == "3"  # 3 $/h for an hour, one good answer
    text = markdown([run])
    assert text.startswith("# Scorecard") and "| continuous @1/s | 1.00 |" in text
    assert "## Per request class (fairness)" in text and "ab" * 32 in text
