"""A shortened soak of `loom serve` (benchmarks/server/soak.py runs the long one): a few hundred
requests over both endpoints, streamed and not, in bursts at five times capacity, with clients
that disconnect or time out, against a KV cache small enough to preempt. Nothing may be lost,
miscounted or leaked."""

from __future__ import annotations

import asyncio
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
from server_helpers import serve_process

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: benchmarks.*
from benchmarks.server import soak  # noqa: E402 - the soak driver lives with the long benchmark

pytestmark = pytest.mark.integration

NUM_REQUESTS = 240


def test_short_soak_loses_and_leaks_nothing() -> None:
    with serve_process(*soak.SERVER_FLAGS) as server:
        report = asyncio.run(soak.soak(server.url, NUM_REQUESTS, server.pid))
        log = server.log_path.read_text(errors="replace")
    assert report.outcomes["error"] == 0, report.errors[:5]
    assert sum(report.outcomes.values()) == report.sent == NUM_REQUESTS
    assert report.outcomes["ok"] > 0 and report.outcomes["cancelled"] > 0
    # each request once in /metrics; if not, what the next look needs to find the lost ones
    assert report.counted == NUM_REQUESTS, _miscount(report, log)
    m = report.metrics
    assert m["loom:kv_cache_usage_perc"] == 0  # no block leaked
    assert m["loom:num_requests_running"] == m["loom:num_requests_waiting"] == 0


def _miscount(report: soak.SoakReport, log: str) -> str:
    statuses = Counter(re.findall(r'HTTP/1\.1" (\d{3})', log))
    warnings = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
    return (f"counted {report.counted:.0f} of {report.sent}\n"
            f"client: {dict(report.details)}\nmetrics: {soak.counted_parts(report.metrics)}, "
            f"running {report.metrics.get('loom:num_requests_running')}, "
            f"waiting {report.metrics.get('loom:num_requests_waiting')}\n"
            f"access log statuses: {dict(statuses)}\n"
            f"warnings and errors other than rejections (last 20): "
            f"{[w for w in warnings if 'Rejected request' not in w][-20:]}")
