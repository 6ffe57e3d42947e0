"""Bursts and overload as outcomes: what a burst above the normal rate did.

A run with `--burst` is split by when each request was due: before the burst, during it and
after it (a run standing for repeats counts the requests of all of them). Per phase: how
many requests were answered, refused (503/429), timed out, walked away from or failed, and
their p95 TTFT; the goodput during the burst (requests answered within the SLO, else
answered at all, per second of burst); what the server did with the extra load (refused it,
let latency spike, or absorbed it; with its peak queue); how long after the burst every
request was served normally again; and which class and tenant paid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.bench.fairness import by_group, ideal_speeds
from loom.workload.arrivals import Burst
from loom.workload.jsonview import JsonView
from loom.workload.requests import CANCELLED, OK, REJECTED, TIMEOUT, RequestResult
from loom.workload.results import RunResult, as_run
from loom.workload.slo import Slo

SPIKE = 2.0  # p95 TTFT during the burst / before it that counts as a latency spike
NORMAL = 2.0  # a request is served normally again within this factor of the p95 TTFT before
PHASES = ("before", "during", "after")


def phase_of(r: RequestResult, burst: Burst) -> str:
    if r.scheduled_s < burst.start_s:
        return "before"
    return "during" if r.scheduled_s < burst.end_s else "after"


@dataclass(frozen=True)
class PhaseOutcome(JsonView):
    """What became of the requests due in one phase of a burst."""

    sent: int
    completed: int
    rejected: int
    timeouts: int
    cancelled: int
    errors: int
    p95_ttft_ms: float | None

    @classmethod
    def of(cls, requests: list[RequestResult]) -> PhaseOutcome:
        ttfts = [r.ttft_s for r in requests if r.status == OK and r.ttft_s is not None]
        counts = {status: sum(r.status == status for r in requests)
                  for status in (OK, REJECTED, TIMEOUT, CANCELLED)}
        return cls(len(requests), counts[OK], counts[REJECTED], counts[TIMEOUT],
                   counts[CANCELLED], len(requests) - sum(counts.values()),
                   1000 * float(np.percentile(ttfts, 95)) if ttfts else None)


@dataclass(frozen=True)
class BurstOutcome(JsonView):
    """What a run's burst did (see the module doc): `response` is "rejection", "latency
    spike" or "absorbed"; `paid` names the class and tenant whose slowdown rose most."""

    burst: Burst
    before: PhaseOutcome
    during: PhaseOutcome
    after: PhaseOutcome
    goodput_during: float
    goodput_basis: str
    queue_peak_during: float | None
    response: str
    recovery_s: float | None
    paid: dict[str, Any] = field(default_factory=dict)


def burst_outcomes(run: RunResult | Mapping[str, Any],
                   slo: Slo | None = None) -> BurstOutcome | None:
    """The outcomes of a run's burst (see the module doc); None for a run without one."""
    run = as_run(run)
    burst = run.load.burst
    if not burst:
        return None
    phases = {p: [r for r in run.requests if phase_of(r, burst) == p] for p in PHASES}
    outcomes = {p: PhaseOutcome.of(rs) for p, rs in phases.items()}
    good = [r for r in phases["during"] if (slo.good(r) if slo else r.status == OK)]
    before, during = outcomes["before"].p95_ttft_ms, outcomes["during"].p95_ttft_ms
    waiting = [e["waiting"] for e in run.timeline if e.get("waiting") is not None
               and burst.start_s <= e["t"] < burst.end_s + 1]
    if outcomes["during"].rejected:
        response = "rejection"
    elif before and during and during >= SPIKE * before:
        response = "latency spike"
    else:
        response = "absorbed"
    return BurstOutcome(
        burst, **outcomes, goodput_during=len(good) / (burst.length_s * run.repeats),
        goodput_basis=f"within {slo}" if slo else "completed",
        queue_peak_during=max(waiting) if waiting else None, response=response,
        recovery_s=recovery_s(phases["after"], before, burst.end_s),
        paid=who_paid(run.requests, burst))


def recovery_s(after: list[RequestResult], before_p95_ms: float | None,
               end_s: float) -> float | None:
    """Seconds after the burst's end until every later request is served normally (answered,
    TTFT within NORMAL x the p95 before the burst); None when the run never got there (or
    has no baseline or no requests after the burst)."""
    if not after or not before_p95_ms:
        return None
    limit = NORMAL * before_p95_ms / 1000
    ordered = sorted(after, key=lambda r: r.scheduled_s)
    abnormal = [i for i, r in enumerate(ordered)
                if r.status != OK or r.ttft_s is None or r.ttft_s > limit]
    if not abnormal:
        return 0.0
    if abnormal[-1] == len(ordered) - 1:
        return None
    return max(0.0, ordered[abnormal[-1] + 1].scheduled_s - end_s)


def who_paid(requests: list[RequestResult], burst: Burst) -> dict[str, Any]:
    """Per class and per tenant: mean slowdown during the burst over before it; the group
    with the largest rise paid most."""
    speeds = ideal_speeds(requests)
    out: dict[str, Any] = {}
    if speeds is None:
        return out
    for name, key in (("class", lambda r: r.cls), ("tenant", lambda r: r.tenant)):
        before = by_group([r for r in requests if phase_of(r, burst) == "before"], key, speeds)
        during = by_group([r for r in requests if phase_of(r, burst) == "during"], key, speeds)
        rises = {g: during[g].mean_slowdown / before[g].mean_slowdown for g in during
                 if g in before and during[g].mean_slowdown and before[g].mean_slowdown}
        if rises:
            out[name] = max(rises, key=lambda g: rises[g])
            out[f"{name}_slowdown_rise"] = rises
    return out
