"""A shortened soak of `loom serve` (benchmarks/soak.py runs the long one): a few hundred
requests over both endpoints, streamed and not, in bursts at five times capacity, with clients
that disconnect or time out, against a KV cache small enough to preempt. Nothing may be lost,
miscounted or leaked."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from server_helpers import serve_process

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import soak  # noqa: E402 - the soak driver lives with the benchmark that runs it long

pytestmark = pytest.mark.integration

NUM_REQUESTS = 240


def test_short_soak_loses_and_leaks_nothing() -> None:
    with serve_process(*soak.SERVER_FLAGS) as server:
        report = asyncio.run(soak.soak(server.url, NUM_REQUESTS, server.pid))
    assert report.outcomes["error"] == 0, report.errors[:5]
    assert sum(report.outcomes.values()) == report.sent == NUM_REQUESTS
    assert report.outcomes["ok"] > 0 and report.outcomes["cancelled"] > 0
    assert report.counted == NUM_REQUESTS  # each request once in /metrics
    m = report.metrics
    assert m["loom:kv_cache_usage_perc"] == 0  # no block leaked
    assert m["loom:num_requests_running"] == m["loom:num_requests_waiting"] == 0
