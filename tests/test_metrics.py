"""The periodic stats log line reads the same counters /metrics exports."""

from __future__ import annotations

import logging

import pytest

from loom.engine.metrics import EngineMetrics

pytestmark = pytest.mark.unit


def test_stats_line_reports_rates_state_and_hit_rate(caplog) -> None:
    metrics = EngineMetrics("m", log_interval_s=0.0)
    metrics.prefix_queries.inc(200)
    metrics.prefix_hits.inc(50)
    metrics.running.set(3)
    metrics.waiting.set(2)
    metrics.kv_usage.set(0.25)
    metrics.preemptions.inc(4)
    with caplog.at_level(logging.INFO, logger="loom.stats"):
        metrics.maybe_log_stats(busy=True)
    line = caplog.records[-1].getMessage()
    for part in ("Running: 3 reqs", "Waiting: 2 reqs", "KV cache usage: 25.0%",
                 "Preemptions: 4", "Prefix cache hit rate: 25.0%"):
        assert part in line


def test_stats_line_is_quiet_while_idle(caplog) -> None:
    metrics = EngineMetrics("m", log_interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="loom.stats"):
        metrics.maybe_log_stats(busy=False)
    assert not caplog.records


def test_an_abort_inside_the_rejection_block_counts_once_as_rejected() -> None:
    metrics = EngineMetrics("m")
    with metrics.abort_counts_as_rejected():
        metrics.finished("abort")
    metrics.finished("abort")
    values = metrics.snapshot()
    assert values["loom:request_rejected_total"] == 1
    assert values["loom:request_success_total{finished_reason=abort}"] == 1
