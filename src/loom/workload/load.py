"""The offered load of a run: how fast requests are sent, for how long, by how many users.
`loom bench` sends it to a server, `loom simulate` to the simulated engine; both read it
from the same flags.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loom.config import option, require_at_least
from loom.workload.arrivals import TRACE_RATE, Burst, RampUp
from loom.workload.trace import Trace


def parse_count(text: str) -> int:
    """A count of requests: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"expected an integer >= 1, got {text!r}")
    return value


def parse_rate(text: str) -> float | str:
    """A --rate: requests/s > 0, 'inf' (all at once) or 'trace' (as recorded)."""
    if text in (TRACE_RATE, "inf"):
        return text if text == TRACE_RATE else math.inf
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"a rate is requests/s > 0, 'inf' or 'trace'; got {text!r}")
    return value


@dataclass(frozen=True)
class Load:
    """The offered load of one run.

    rate: requests/s, math.inf, or "trace" (the trace's arrival_s). max_concurrency caps
    requests in flight; with rate inf it is the closed loop of N users. Without duration_s
    or num_requests the trace is sent once; with them it is cycled as far as needed.
    """

    CLI_GROUP = "Load"

    rate: float | str = option(math.inf,
        "offered req/s, 'inf' (all at once) or 'trace' (arrival_s as recorded); give it, "
        "--max-concurrency, or both", parse=parse_rate)
    burstiness: float = option(1.0,
        "gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier")
    max_concurrency: int | None = option(None,
        "requests in flight at most; alone (rate inf): closed loop of N users; default: no "
        "cap")
    duration_s: float | None = option(None,
        "seconds to keep sending (cycling the trace); in-flight ones finish; default: send "
        "the trace (or -n requests) once", flag="--duration")
    burst: Burst | None = option(None,
        "a burst phase: FACTOR times the rate for SECONDS, from START (default 10 s), e.g. "
        "5x:30s or 5x:30s@20s; default: none", parse=Burst.parse)
    ramp_up: RampUp | None = option(None,
        "grow the rate from 0 over the first seconds, e.g. linear:60s; default: full rate "
        "from the start", parse=RampUp.parse)
    over_saturation_s: float | None = option(None,
        "stop sending at a load once the requests in flight have kept growing for this many "
        "seconds (choose it above a request's E2E); the sweep stops there; default: never",
        flag="--over-saturation-stop")
    num_requests: int | None = option(None,
        "requests to send, cycling the trace if needed; default: the whole trace once (or, "
        "with --duration, as many as fit)", parse=parse_count)
    seed: int = option(0,
        "seed of everything random: lengths, arrivals, synthetic prompts")

    def __post_init__(self) -> None:
        """Refuse a load that would send nothing or divide by zero, naming the flag, before
        any connection is opened."""
        require_at_least(1, {"--max-concurrency": self.max_concurrency, "-n": self.num_requests})
        if not 0 < self.burstiness < math.inf:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness:g}")
        for flag, value in (("--duration", self.duration_s),
                            ("--over-saturation-stop", self.over_saturation_s)):
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{flag} must be > 0, got {value:g} s")

    def check_runnable(self, trace: Trace) -> None:
        """Refuse what only the schedule would find, mid-run: a burst or ramp-up without a
        finite rate, an unlimited rate that never stops, --rate trace without arrivals."""
        if self.rate == math.inf and (self.burst or self.ramp_up):
            raise ValueError("--burst and --ramp-up need a finite --rate (or --rate trace)")
        if self.rate == math.inf and self.max_concurrency is None and self.duration_s:
            raise ValueError("an unlimited rate with --duration never stops sending; "
                             "give --rate or --max-concurrency")
        if self.rate == TRACE_RATE and any(r.arrival_s is None for r in trace.requests):
            raise ValueError("--rate trace needs arrival_s on every request of the trace")

    @property
    def rate_name(self) -> float | str:
        """The rate as a result records it: req/s, "inf" or "trace" (JSON has no inf)."""
        return self.rate if self.rate == TRACE_RATE or math.isfinite(self.rate) else "inf"

    @property
    def point_name(self) -> str:
        """The load's name in a sweep's run labels: "@2/s", "x8" (users) or "trace arrivals"."""
        if self.rate == TRACE_RATE:
            return "trace arrivals"
        if math.isinf(self.rate):
            return f"x{self.max_concurrency}" if self.max_concurrency else "all at once"
        return f"@{self.rate:g}/s"

    def to_json(self) -> dict[str, Any]:
        """What a run result records of its load (its own keys, vLLM's where it has them)."""
        return {"request_rate": self.rate_name, "burstiness": self.burstiness,
                "max_concurrency": self.max_concurrency, "duration_limit_s": self.duration_s,
                "num_requests_limit": self.num_requests, "seed": self.seed,
                "burst": self.burst.to_json() if self.burst else None,
                "ramp_up": self.ramp_up.to_json() if self.ramp_up else None}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Load:
        """The load a result records (an older file lacks some: the defaults)."""
        rate = obj.get("request_rate", "inf")
        return cls(rate=math.inf if rate == "inf" else rate,
                   burstiness=obj.get("burstiness") or 1.0,
                   max_concurrency=obj.get("max_concurrency"),
                   duration_s=obj.get("duration_limit_s"),
                   num_requests=obj.get("num_requests_limit"), seed=obj.get("seed") or 0,
                   burst=Burst.from_json(obj["burst"]) if obj.get("burst") else None,
                   ramp_up=RampUp.from_json(obj["ramp_up"]) if obj.get("ramp_up") else None)
