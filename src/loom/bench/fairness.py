"""Fairness per request class and per tenant: does one kind of traffic pay for another?

Latencies of different classes are not comparable as they are (a 1,000-token prompt takes
longer than a 30-token one on an idle server), so each completed request's E2E is divided by
its ideal: its prompt at the run's best prefill speed plus its output at the run's best
decode speed (the 5th percentiles of TTFT per prompt token and of TPOT over the run), floored
at 1. Jain's index over the groups' mean slowdowns is then 1 when every group is slowed
alike and 1/n when one group takes all the delay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loom.workload.jsonview import JsonView
from loom.workload.requests import OK, RequestResult

BEST = 5  # percentile of the run's speeds taken as "ideal"


def jain(values: list[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 = all equal, 1/n = one takes all."""
    if not values:
        return None
    x = np.asarray(values, dtype=float)
    return float(x.sum() ** 2 / (len(x) * (x * x).sum())) if (x * x).sum() else 1.0


def ideal_speeds(requests: list[RequestResult]) -> tuple[float, float] | None:
    """(seconds per prompt token to the first token, seconds per output token) at the run's
    best; None without completed requests to learn them from."""
    done = [r for r in requests if r.status == OK and r.ttft_s is not None]
    prefill = [r.ttft_s / r.prompt_len for r in done if r.prompt_len]
    decode = [r.tpot_s for r in done if r.tpot_s is not None]
    if not prefill:
        return None
    return (float(np.percentile(prefill, BEST)),
            float(np.percentile(decode, BEST)) if decode else 0.0)


def slowdown(r: RequestResult, speeds: tuple[float, float]) -> float | None:
    """E2E / ideal E2E of a completed request (>= 1), None otherwise."""
    if r.status != OK or r.e2e_s is None:
        return None
    ideal = (r.prompt_len or 0) * speeds[0] + max(r.output_tokens - 1, 0) * speeds[1]
    return max(1.0, r.e2e_s / ideal) if ideal > 0 else None


@dataclass(frozen=True)
class Slowdowns(JsonView):
    """One group's requests and how much slower than their ideal they were served."""

    requests: int
    completed: int
    mean_slowdown: float | None
    p95_slowdown: float | None


def by_group(requests: list[RequestResult], key: Callable[[RequestResult], str | None],
             speeds: tuple[float, float]) -> dict[str, Slowdowns]:
    """Mean and p95 slowdown and counts per group (requests whose key is None are left out)."""
    out: dict[str, Slowdowns] = {}
    for name in sorted({k for r in requests if (k := key(r)) is not None}):
        members = [r for r in requests if key(r) == name]
        values = [s for r in members if (s := slowdown(r, speeds)) is not None]
        out[name] = Slowdowns(len(members), len(values),
                              float(np.mean(values)) if values else None,
                              float(np.percentile(values, 95)) if values else None)
    return out


@dataclass(frozen=True)
class Fairness(JsonView):
    """Slowdowns per request class and per tenant, and Jain's index over each (None with
    fewer than two groups)."""

    ideal_prefill_ms_per_token: float
    ideal_tpot_ms: float
    by_class: dict[str, Slowdowns]
    jain_class: float | None
    by_tenant: dict[str, Slowdowns]
    jain_tenant: float | None


def fairness(requests: list[RequestResult]) -> Fairness | None:
    """Per-class and per-tenant slowdowns and their Jain indices; None when nothing
    completed."""
    speeds = ideal_speeds(requests)
    if speeds is None:
        return None
    by_class = by_group(requests, lambda r: r.cls, speeds)
    by_tenant = by_group(requests, lambda r: r.tenant, speeds)
    return Fairness(1000 * speeds[0], 1000 * speeds[1], by_class, _jain_of(by_class),
                    by_tenant, _jain_of(by_tenant))


def _jain_of(groups: dict[str, Slowdowns]) -> float | None:
    means = [g.mean_slowdown for g in groups.values() if g.mean_slowdown is not None]
    return jain(means) if len(means) > 1 else None
