"""What a sweep runs: its points (offered rates, closed-loop concurrencies, or a search for
the knee) on one base load, the limits that end it, and the SLO its runs are judged by. A
sweep of a server (bench/sweep.py) and of the simulator (sim/whatif.py) read the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from loom.config import option
from loom.workload.load import Load
from loom.workload.results import Limits
from loom.workload.slo import Slo


@dataclass(frozen=True)
class AutoSearch:
    CLI_GROUP = "Knee search (--auto)"

    start_rate: float = option(0.5, "first rate")
    max_rate: float = option(64.0, "highest rate to try")
    bisect_steps: int = option(2,
        "bisections after a limit is crossed")

    def __post_init__(self) -> None:
        """A search that would run nothing (or never end) is refused before it starts."""
        if not 0 < self.start_rate < math.inf:
            raise ValueError(f"--start-rate must be > 0, got {self.start_rate:g}")
        if not self.start_rate <= self.max_rate < math.inf:
            raise ValueError(f"--max-rate ({self.max_rate:g}) must be at least --start-rate "
                             f"({self.start_rate:g})")
        if self.bisect_steps < 0:
            raise ValueError(f"--bisect-steps must be >= 0, got {self.bisect_steps}")


@dataclass(frozen=True)
class SweepSpec:
    """A sweep's points on `load` (exactly one of rates, concurrencies and auto), its limits
    and SLO; rates run in ascending order, each once."""

    load: Load = field(default_factory=Load)
    limits: Limits = field(default_factory=Limits)
    rates: Sequence[float] | None = None
    concurrencies: Sequence[int] | None = None
    auto: AutoSearch | None = None
    slo: Slo | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.rates, self.concurrencies, self.auto)) != 1:
            raise ValueError("give exactly one of --rates, --overlap or --auto")
        if self.rates is not None:
            object.__setattr__(self, "rates", sorted(set(self.rates)))

    def loads(self) -> list[Load]:
        """The load of each point (for --auto, its first), to check before running any."""
        if self.concurrencies is not None:
            return [replace(self.load, rate=math.inf, max_concurrency=c)
                    for c in self.concurrencies]
        return [replace(self.load, rate=r) for r in self.rates or [self.auto.start_rate]]
