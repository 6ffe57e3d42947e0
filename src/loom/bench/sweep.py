"""Sweeps: the same trace at rising offered load, from below the expected load up to where
p95 queue time or the error rate crosses the limit you can accept (or, with
--over-saturation-stop, the queue keeps growing), or at 1/2/4/8... overlapping requests (a
closed loop of N users, as a home server with a few users sees).

`--auto` looks for the knee without a list of rates: double the rate until a limit is
crossed, then bisect between the last rate within the limits and the first beyond them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from loom.bench.replay import Load, Target, replay
from loom.bench.results import Slo
from loom.bench.trace import Trace
from loom.config import flag_help


@dataclass(frozen=True)
class Limits:
    """What "unacceptable" means for a sweep."""

    CLI_GROUP = "Sweep limits"

    max_p95_queue_s: float = field(default=2.0, metadata=flag_help(
        "p95 queue time in seconds (server metric; else p95 TTFT)", flag="--max-p95-queue"))
    max_error_rate: float = field(default=0.05, metadata=flag_help("failed / sent"))

    def __post_init__(self) -> None:
        if not 0 <= self.max_p95_queue_s < math.inf:
            raise ValueError(f"--max-p95-queue must be >= 0 s, got {self.max_p95_queue_s:g}")
        if not 0 <= self.max_error_rate <= 1:
            raise ValueError(f"--max-error-rate must be from 0 to 1, got "
                             f"{self.max_error_rate:g}")

    def crossed(self, run: dict[str, Any]) -> list[str]:
        """Why `run` is beyond the limits (empty: within them). Queue time is the server's
        (from /metrics); a server without it is judged by p95 TTFT, which includes it."""
        reasons = []
        queue_ms, what = (run.get("queue_time") or {}).get("p95_ms"), "p95 queue time"
        if queue_ms is None:
            queue_ms, what = run.get("p95_ttft_ms"), "p95 TTFT (no server queue metric)"
        if queue_ms is not None and queue_ms > 1000 * self.max_p95_queue_s:
            reasons.append(f"{what} {queue_ms / 1000:.2f} s > {self.max_p95_queue_s:g} s")
        if run["error_rate"] > self.max_error_rate:
            reasons.append(f"error rate {run['error_rate']:.1%} > {self.max_error_rate:.1%}")
        if run["completed"] == 0:
            reasons.append("no request completed")
        if run.get("over_saturated_at_s") is not None:
            reasons.append(f"over-saturated: the queue kept growing; sending stopped at "
                           f"{run['over_saturated_at_s']:.0f} s")
        return reasons


@dataclass(frozen=True)
class AutoSearch:
    CLI_GROUP = "Knee search (--auto)"

    start_rate: float = field(default=0.5, metadata=flag_help("first rate"))
    max_rate: float = field(default=64.0, metadata=flag_help("highest rate to try"))
    bisect_steps: int = field(default=2, metadata=flag_help(
        "bisections after a limit is crossed"))

    def __post_init__(self) -> None:
        """A search that would run nothing (or never end) is refused before it starts."""
        if not 0 < self.start_rate < math.inf:
            raise ValueError(f"--start-rate must be > 0, got {self.start_rate:g}")
        if not self.start_rate <= self.max_rate < math.inf:
            raise ValueError(f"--max-rate ({self.max_rate:g}) must be at least --start-rate "
                             f"({self.start_rate:g})")
        if self.bisect_steps < 0:
            raise ValueError(f"--bisect-steps must be >= 0, got {self.bisect_steps}")


async def sweep(trace: Trace, base: Load, target: Target, limits: Limits,
                rates: list[float] | None = None, concurrencies: list[int] | None = None,
                auto: AutoSearch | None = None, slo: Slo | None = None,
                label: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Run `trace` at each point; returns the sweep result with every run and the knee (the
    highest offered rate found within the limits). Exactly one of rates / concurrencies /
    auto. Rates run in ascending order (the knee is the last one within the limits) and stop
    after the first beyond them; concurrencies run all. Every point's load is checked before
    the first is sent, so a bad one cannot throw away the runs before it."""
    if sum(x is not None for x in (rates, concurrencies, auto)) != 1:
        raise ValueError("give exactly one of --rates, --overlap or --auto")
    if rates is not None:
        rates = sorted(set(rates))
    for load in _loads(base, rates, concurrencies, auto):
        load.check_runnable(trace)
    runs: list[dict[str, Any]] = []
    name = label or "sweep"

    async def run(load: Load, point: str) -> dict[str, Any]:
        result = await replay(trace, load, target, slo, f"{name} {point}", progress)
        result["limits_crossed"] = limits.crossed(result)
        runs.append(result)
        return result

    knee = None
    if concurrencies is not None:
        for c in concurrencies:
            await run(replace(base, rate=math.inf, max_concurrency=c), f"x{c}")
    elif rates is not None:
        for rate in rates:
            if (await run(replace(base, rate=rate), f"@{rate:g}/s"))["limits_crossed"]:
                break
            knee = rate
    else:
        knee = await _auto(auto, lambda r: run(replace(base, rate=r), f"@{r:.3g}/s"))
    runs.sort(key=lambda r: (r["max_concurrency"] or 0, _rate(r)))
    return {"kind": "sweep", "label": name, "limits": vars(limits),
            "points": "concurrency" if concurrencies is not None else "rate",
            "knee_rate": knee, "trace": trace.describe(), "runs": runs}


def _loads(base: Load, rates: list[float] | None, concurrencies: list[int] | None,
           auto: AutoSearch | None) -> list[Load]:
    """The loads a sweep may run (for --auto, its first), to check before running any."""
    if concurrencies is not None:
        return [replace(base, rate=math.inf, max_concurrency=c) for c in concurrencies]
    return [replace(base, rate=r) for r in rates or [auto.start_rate]]


async def _auto(auto: AutoSearch, run: Any) -> float | None:
    good, bad = None, None
    rate = auto.start_rate
    while rate <= auto.max_rate:
        if (await run(rate))["limits_crossed"]:
            bad = rate
            break
        good, rate = rate, rate * 2
    for _ in range(auto.bisect_steps if good is not None and bad is not None else 0):
        mid = math.sqrt(good * bad)  # geometric: rates were doubled, so halve the ratio
        if (await run(mid))["limits_crossed"]:
            bad = mid
        else:
            good = mid
    return good


def _rate(run: dict[str, Any]) -> float:
    rate = run["request_rate"]
    return rate if isinstance(rate, (int, float)) else math.inf
