"""When each request is sent: open-loop arrivals at an offered rate (Poisson or gamma), the
trace's own recorded arrivals, or all at once (closed loop, paced by the client's users).

Offered load is what a sweep varies, so the arrival process is explicit and seeded: the same
seed gives the same send times against every server and configuration.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

from loom.bench.trace import TraceRequest

TRACE_RATE = "trace"  # --rate trace: replay arrival_s as recorded


def gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Inter-arrival gaps with mean 1/rate. Gamma with shape `burstiness` (as in
    `vllm bench serve`): 1 is a Poisson process, < 1 burstier, > 1 more regular."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    scale = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def schedule(requests: list[TraceRequest], rate: float | str, burstiness: float = 1.0,
             seed: int = 0, cycle: bool = False) -> Iterator[tuple[float, TraceRequest]]:
    """(send offset in seconds, request) in send order.

    rate: requests/s, math.inf (everything at t=0; with a concurrency limit this is the
    closed loop), or "trace". cycle: repeat the trace for ever (for --duration runs).
    """
    if rate == TRACE_RATE:
        yield from _trace_schedule(requests, cycle)
        return
    if not isinstance(rate, (int, float)) or rate <= 0:
        raise ValueError(f"rate must be > 0, inf or 'trace', got {rate!r}")
    source = itertools.cycle(requests) if cycle else iter(requests)
    if math.isinf(rate):
        for request in source:
            yield 0.0, request
        return
    t = 0.0
    for request, gap in zip(source, gaps(rate, burstiness, random.Random(seed))):
        yield t, request
        t += gap


def _trace_schedule(requests: list[TraceRequest],
                    cycle: bool) -> Iterator[tuple[float, TraceRequest]]:
    if any(r.arrival_s is None for r in requests):
        raise ValueError("--rate trace needs arrival_s on every request of the trace")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    start = ordered[0].arrival_s
    span = ordered[-1].arrival_s - start
    # one round's span plus a mean gap, so a cycled trace keeps its average rate
    period = span + (span / (len(ordered) - 1) if len(ordered) > 1 else 1.0)
    for round_ in itertools.count():
        for r in ordered:
            yield round_ * period + r.arrival_s - start, r
        if not cycle:
            return
