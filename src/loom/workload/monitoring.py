"""What was watched while a run's requests went out, besides the requests: the server's own
figures (queue time, preemptions, KV usage, from its /metrics or a simulation's exact
counts) and the load generator's pace (a late send is the client's queueing, not the
server's, and must not be mistaken for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from loom.workload.figures import PERCENTILES
from loom.workload.jsonview import JsonView
from loom.workload.requests import RequestResult

# One timeline sample: "t" (s from the start), "client_in_flight", and what the server's
# gauges said then ("running", "waiting", "kv_usage", "preemptions", "server_rss_bytes").
Sample = dict[str, float]

# A client is "limited" (it, not the server, set the pace) when any of these is crossed.
CLIENT_SEND_LAG_S = 0.25   # p95 lateness of open-loop sends
CLIENT_LOOP_LAG_S = 0.1    # p95 oversleep of the client's event loop
CLIENT_CPU_SHARE = 0.9     # of one core: the client's process had no CPU to spare


@dataclass(frozen=True)
class LatencySummary(JsonView):
    """count, mean and percentiles in ms of a server-side latency (a histogram's estimate,
    or a simulation's exact values)."""

    count: int = 0
    mean_ms: float | None = None
    p50_ms: float | None = None
    p90_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None

    @classmethod
    def exact(cls, values_s: list[float]) -> LatencySummary:
        if not values_s:
            return cls()
        ms = np.asarray(values_s) * 1000.0
        return cls(len(values_s), float(ms.mean()),
                   *(float(v) for v in np.percentile(ms, PERCENTILES)))


@dataclass(frozen=True)
class ServerFigures(JsonView):
    """What the server said about a run: deltas of its counters and histograms over the
    run, peaks and means of its gauges over the timeline; None where it exports nothing."""

    metrics_source: str | None = None
    queue_time: LatencySummary | None = None
    server_ttft: LatencySummary | None = None
    preemptions: int | None = None
    prefix_cache_hit_rate: float | None = None
    server_rejected: int | None = None
    kv_cache_usage_peak: float | None = None
    kv_cache_usage_mean: float | None = None
    num_requests_running_peak: float | None = None
    num_requests_running_mean: float | None = None
    num_requests_waiting_peak: float | None = None
    num_requests_waiting_mean: float | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ServerFigures:
        read = super().from_json(obj)
        return replace(read, **{key: LatencySummary.from_json(obj[key])
                                for key in ("queue_time", "server_ttft") if obj.get(key)})


def gauge_figures(timeline: list[Sample]) -> dict[str, float | None]:
    """Peak and mean of the running, waiting and KV usage gauges over a timeline."""
    out: dict[str, float | None] = {}
    for gauge, key in (("kv_usage", "kv_cache_usage"), ("running", "num_requests_running"),
                       ("waiting", "num_requests_waiting")):
        values = [e[gauge] for e in timeline if e.get(gauge) is not None]
        out[f"{key}_peak"] = max(values) if values else None
        out[f"{key}_mean"] = float(np.mean(values)) if values else None
    return out


@dataclass(frozen=True)
class ClientFigures(JsonView):
    """How well the load generator kept its schedule (see client_figures)."""

    send_lag_p95_ms: float | None = None
    send_lag_max_ms: float | None = None
    in_flight_peak: float | None = None
    in_flight_mean: float | None = None
    cpu_s: float | None = None
    cpu_share: float | None = None
    loop_lag_p95_ms: float | None = None
    loop_lag_max_ms: float | None = None
    limited_reasons: list[str] | None = None  # None: a result from before they were kept
    limited: bool = False


def client_figures(results: list[RequestResult], timeline: list[Sample],
                   stats: Mapping[str, float] | None = None,
                   loop_lags_s: list[float] | None = None,
                   closed_loop: bool = False) -> ClientFigures:
    """How well the load generator kept its schedule: a late send is the client's queueing,
    not the server's, and must not be mistaken for it. In a closed loop a send waits for a
    free user by design, so there only the event loop's lateness and the CPU count.
    `stats`: the client process's cpu_s and wall_s over the run."""
    lags = [max(0.0, r.start_s - r.scheduled_s) for r in results]
    in_flight = [e["client_in_flight"] for e in timeline]
    figures = ClientFigures(
        send_lag_p95_ms=float(np.percentile(lags, 95)) * 1000 if lags else None,
        send_lag_max_ms=max(lags) * 1000 if lags else None,
        in_flight_peak=max(in_flight) if in_flight else None,
        in_flight_mean=float(np.mean(in_flight)) if in_flight else None,
        cpu_s=stats["cpu_s"] if stats else None,
        cpu_share=stats["cpu_s"] / max(stats["wall_s"], 1e-9) if stats else None,
        loop_lag_p95_ms=float(np.percentile(loop_lags_s, 95)) * 1000 if loop_lags_s else None,
        loop_lag_max_ms=max(loop_lags_s) * 1000 if loop_lags_s else None)
    reasons = client_limits(figures, closed_loop)
    return replace(figures, limited_reasons=reasons, limited=bool(reasons))


def client_limits(client: ClientFigures, closed_loop: bool) -> list[str]:
    """Why the client, not the server, may have limited a run (empty: it kept pace)."""
    reasons = []
    lag, loop = client.send_lag_p95_ms, client.loop_lag_p95_ms
    if not closed_loop and lag is not None and lag > 1000 * CLIENT_SEND_LAG_S:
        reasons.append(f"p95 send lag {lag / 1000:.2f} s behind schedule")
    if loop is not None and loop > 1000 * CLIENT_LOOP_LAG_S:
        reasons.append(f"the client's event loop woke p95 {loop:.0f} ms late")
    share = client.cpu_share
    if share is not None and share >= CLIENT_CPU_SHARE:
        reasons.append(f"the client used {share:.0%} of a core")
    return reasons


@dataclass(frozen=True)
class ServerMemory(JsonView):
    """A local server process tree's peak memory over a run, in bytes."""

    pid: int | None = None
    peak_rss_bytes: int | None = None
    peak_hwm_bytes: int | None = None
    peak_gpu_bytes: int | None = None
