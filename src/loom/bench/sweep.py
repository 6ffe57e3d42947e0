"""Sweeps: the same trace at rising offered load, from below the expected load up to where
p95 queue time or the error rate crosses the limit you can accept (or, with
--over-saturation-stop, the queue keeps growing), or at 1/2/4/8... overlapping requests (a
closed loop of N users, as a home server with a few users sees).

`--auto` looks for the knee without a list of rates: double the rate until a limit is
crossed, then bisect between the last rate within the limits and the first beyond them.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import replace

from loom.bench.replay import Target, replay
from loom.workload.load import Load
from loom.workload.results import Limits, RunResult, SweepResult
from loom.workload.slo import Slo
from loom.workload.sweeps import AutoSearch, SweepSpec
from loom.workload.trace import Trace


async def sweep(trace: Trace, base: Load, target: Target, limits: Limits,
                rates: list[float] | None = None, concurrencies: list[int] | None = None,
                auto: AutoSearch | None = None, slo: Slo | None = None,
                label: str | None = None, progress: bool = True) -> SweepResult:
    """Run `trace` at each point; returns the sweep result with every run and the knee (the
    highest offered rate found within the limits). Exactly one of rates / concurrencies /
    auto. Rates run in ascending order (the knee is the last one within the limits) and stop
    after the first beyond them; concurrencies run all. Every point's load is checked before
    the first is sent, so a bad one cannot throw away the runs before it."""
    points = SweepSpec(base, limits, rates, concurrencies, auto, slo)
    for load in points.loads():
        load.check_runnable(trace)
    runs: list[RunResult] = []
    name = label or "sweep"

    async def run(load: Load, point: str | None = None) -> RunResult:
        result = await replay(trace, load, target, slo, f"{name} {point or load.point_name}",
                              progress)
        result = replace(result, limits_crossed=limits.crossed(result))
        runs.append(result)
        return result

    knee = None
    if concurrencies is not None:
        for load in points.loads():
            await run(load)
    elif points.rates is not None:
        for load in points.loads():
            if (await run(load)).limits_crossed:
                break
            knee = load.rate
    else:
        knee = await _auto(auto, lambda r: run(replace(base, rate=r), f"@{r:.3g}/s"))
    runs.sort(key=lambda r: (r.max_concurrency or 0, r.rate_order))
    return SweepResult(name, runs, knee, "concurrency" if concurrencies is not None else "rate",
                       limits, trace.describe())


async def _auto(auto: AutoSearch,
                run: Callable[[float], Awaitable[RunResult]]) -> float | None:
    good, bad = None, None
    rate = auto.start_rate
    while rate <= auto.max_rate:
        if (await run(rate)).limits_crossed:
            bad = rate
            break
        good, rate = rate, rate * 2
    for _ in range(auto.bisect_steps if good is not None and bad is not None else 0):
        mid = math.sqrt(good * bad)  # geometric: rates were doubled, so halve the ratio
        if (await run(mid)).limits_crossed:
            bad = mid
        else:
            good = mid
    return good
