"""What was watched while a run's requests went out, besides the requests: the server's own
figures (queue time, preemptions, KV usage, from its /metrics or a simulation's exact
counts) and the load generator's pace (a late send is the client's queueing, not the
server's, and must not be mistaken for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from loom.workload.figures import Latency
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
class Gauge:
    """A server gauge over a run's timeline: its peak and its mean (None: never reported)."""

    peak: float | None = None
    mean: float | None = None

    @classmethod
    def of(cls, timeline: list[Sample], name: str) -> Gauge:
        values = [e[name] for e in timeline if e.get(name) is not None]
        return cls(max(values), float(np.mean(values))) if values else cls()


# a gauge's timeline name -> its figures' names in a result (`kv_cache_usage_peak`, ...)
GAUGES = {"kv_usage": "kv_cache_usage", "running": "num_requests_running",
          "waiting": "num_requests_waiting"}


@dataclass(frozen=True)
class ServerFigures(JsonView):
    """What the server said about a run: deltas of its counters and histograms over the
    run, peaks and means of its gauges over the timeline; None where it exports nothing."""

    metrics_source: str | None = None
    kv_cache_usage: Gauge = field(default_factory=Gauge)
    queue_time: Latency | None = None
    server_ttft: Latency | None = None
    num_requests_running: Gauge = field(default_factory=Gauge)
    preemptions: int | None = None
    server_rejected: int | None = None
    num_requests_waiting: Gauge = field(default_factory=Gauge)
    prefix_cache_hit_rate: float | None = None

    @classmethod
    def of(cls, timeline: list[Sample], **counted: Any) -> ServerFigures:
        """The gauges from the timeline, the rest (`counted`) as the caller counted it."""
        return cls(**counted, **{key: Gauge.of(timeline, name) for name, key in GAUGES.items()})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"metrics_source": self.metrics_source}
        for key in ("queue_time", "server_ttft"):
            latency = getattr(self, key)
            out[key] = latency.summary() if latency else None
        out.update(preemptions=self.preemptions, prefix_cache_hit_rate=self.prefix_cache_hit_rate,
                   server_rejected=self.server_rejected)
        for key in GAUGES.values():
            gauge = getattr(self, key)
            out.update({f"{key}_peak": gauge.peak, f"{key}_mean": gauge.mean})
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ServerFigures:
        return cls(obj.get("metrics_source"), **{
            key: Gauge(obj.get(f"{key}_peak"), obj.get(f"{key}_mean"))
            for key in GAUGES.values()}, **{
            key: Latency.from_summary(obj[key]) for key in ("queue_time", "server_ttft")
            if obj.get(key)}, preemptions=obj.get("preemptions"),
            server_rejected=obj.get("server_rejected"),
            prefix_cache_hit_rate=obj.get("prefix_cache_hit_rate"))


@dataclass(frozen=True)
class ClientFigures(JsonView):
    """How well the load generator kept its schedule (see client_figures)."""

    send_lag_p95_ms: float | None = None
    send_lag_max_ms: float | None = None
    limited: bool = False
    in_flight_peak: float | None = None
    in_flight_mean: float | None = None
    limited_reasons: list[str] | None = None  # None: a result from before they were kept
    cpu_s: float | None = None
    cpu_share: float | None = None
    loop_lag_p95_ms: float | None = None
    loop_lag_max_ms: float | None = None


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
