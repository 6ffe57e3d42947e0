"""When each request is sent: open-loop arrivals at an offered rate (Poisson or gamma), the
trace's own recorded arrivals, or all at once (closed loop, paced by the client's users).

Offered load is what a sweep varies, so the arrival process is explicit and seeded: the same
seed gives the same send times against every server and configuration. A ramp-up and a burst
reshape the rate over time without changing the draws: arrivals are drawn on an "operational"
clock at the base rate and mapped to wall time through the cumulative rate multiplier, so a
burst phase is the same requests, packed `factor` times closer.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from loom.workload.trace import TraceRequest

TRACE_RATE = "trace"  # --rate trace: replay arrival_s as recorded


def _match(pattern: str, text: str, expected: str) -> re.Match[str]:
    match = re.fullmatch(pattern, text.strip())
    if not match:
        raise ValueError(f"expected {expected}; got {text!r}")
    return match


@dataclass(frozen=True)
class Burst:
    """`--burst 5x:30s[@10s]`: `factor` times the base rate for `length_s` seconds, starting
    `start_s` after the run starts (default 10 s)."""

    factor: float
    length_s: float
    start_s: float = 10.0

    @classmethod
    def parse(cls, text: str) -> Burst:
        match = _match(r"([\d.]+)x:([\d.]+)s?(?:@([\d.]+)s?)?", text,
                       "FACTORx:SECONDSs[@STARTs], e.g. 5x:30s or 5x:30s@10s")
        factor, length = float(match.group(1)), float(match.group(2))
        if factor <= 0 or length <= 0:
            raise ValueError("a burst needs a factor and a length > 0")
        return cls(factor, length, float(match.group(3) or 10.0))

    @property
    def end_s(self) -> float:
        return self.start_s + self.length_s

    def to_json(self) -> dict[str, float]:
        return {"factor": self.factor, "length_s": self.length_s, "start_s": self.start_s,
                "end_s": self.end_s}

    @classmethod
    def from_json(cls, obj: Mapping[str, float]) -> Burst:
        return cls(obj["factor"], obj["length_s"], obj["start_s"])


@dataclass(frozen=True)
class RampUp:
    """`--ramp-up linear:60s`: the rate grows linearly from 0 to the offered rate."""

    length_s: float

    @classmethod
    def parse(cls, text: str) -> RampUp:
        return cls(float(_match(r"linear:([\d.]+)s?", text, "linear:SECONDSs, e.g. "
                                                              "linear:60s").group(1)))

    def to_json(self) -> dict[str, Any]:
        return {"kind": "linear", "length_s": self.length_s}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RampUp:
        return cls(obj["length_s"])


def time_warp(burst: Burst | None, ramp: RampUp | None) -> Callable[[float], float]:
    """Operational time -> wall time: the inverse of the cumulative rate multiplier M(t)
    (ramp: t/T below T; burst: x factor inside its window)."""
    if burst is None and ramp is None:
        return lambda u: u
    length = ramp.length_s if ramp else 0.0

    def ramped(t: float) -> float:  # integral of min(1, s / length) ds over [0, t]
        return t * t / (2 * length) if t < length else t - length / 2

    def cumulative(t: float) -> float:
        if burst is None or t <= burst.start_s:
            return ramped(t)
        inside = ramped(min(t, burst.end_s)) - ramped(burst.start_s)
        return ramped(t) + (burst.factor - 1) * inside

    def invert(u: float) -> float:
        low, high = 0.0, max(1.0, u)
        while cumulative(high) < u:
            high *= 2
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if cumulative(mid) < u else (low, mid)
        return high

    return invert


def gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Inter-arrival gaps with mean 1/rate. Gamma with shape `burstiness` (as in
    `vllm bench serve`): 1 is a Poisson process, < 1 burstier, > 1 more regular."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    scale = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def schedule(requests: list[TraceRequest], rate: float | str, burstiness: float = 1.0,
             seed: int = 0, cycle: bool = False, burst: Burst | None = None,
             ramp: RampUp | None = None) -> Iterator[tuple[float, TraceRequest]]:
    """(send offset in seconds, request) in send order.

    rate: requests/s, math.inf (everything at t=0; with a concurrency limit this is the
    closed loop), or "trace". cycle: repeat the trace for ever (for --duration runs).
    burst / ramp reshape a finite or recorded rate over time (see the module doc).
    """
    warp = time_warp(burst, ramp)
    if rate == TRACE_RATE:
        for t, request in _trace_schedule(requests, cycle):
            yield warp(t), request
        return
    if not isinstance(rate, (int, float)) or rate <= 0:
        raise ValueError(f"rate must be > 0, inf or 'trace', got {rate!r}")
    source = itertools.cycle(requests) if cycle else iter(requests)
    if math.isinf(rate):
        if burst or ramp:
            raise ValueError("--burst and --ramp-up need a finite --rate (or --rate trace)")
        for request in source:
            yield 0.0, request
        return
    t = 0.0
    for request, gap in zip(source, gaps(rate, burstiness, random.Random(seed))):
        yield warp(t), request
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
