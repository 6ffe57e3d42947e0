"""Service-level objectives: the latency a service promises, per request and per run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loom.workload.requests import OK, RequestResult

# an SLO's metric -> its name in a run's figures (`p95_e2el_ms`, as vLLM spells them)
FIGURE_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el"}


@dataclass(frozen=True)
class Slo:
    """Service-level objective, e.g. 'ttft_p95=1.0,e2e_p95=10' (seconds).

    Per request, "good" means ttft <= the ttft limit and e2e <= the e2e limit (and tpot <=
    its limit when given); the percentile in a key is the share of requests the service
    promises to keep within it, which the scorecard checks against the run's percentiles.
    """

    limits: tuple[tuple[str, int, float], ...]  # (metric, percentile, seconds)

    METRICS = tuple(FIGURE_NAMES)

    @classmethod
    def parse(cls, text: str) -> Slo:
        """'ttft_p95=1.0,e2e_p95=10'; a limit is seconds > 0 and a percentile 1-100, else
        every request would miss it (or the term means nothing)."""
        limits = []
        for part in text.split(","):
            key, sep, value = part.partition("=")
            metric, _, pct = key.strip().partition("_p")
            try:
                percentile, seconds = int(pct) if pct else 95, float(value)
            except ValueError:
                percentile = seconds = -1
            if not sep or metric not in cls.METRICS or not 0 < percentile <= 100 \
                    or not 0 < seconds < float("inf"):
                raise ValueError(f"--slo: bad term {part!r}; use e.g. ttft_p95=1.0,e2e_p95=10 "
                                 "(seconds > 0, percentile 1-100)")
            limits.append((metric, percentile, seconds))
        return cls(tuple(limits))

    def __str__(self) -> str:
        return ",".join(f"{m}_p{p}={v:g}" for m, p, v in self.limits)

    def good(self, r: RequestResult) -> bool:
        if r.status != OK:
            return False
        values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
        return all(values[m] is None or values[m] <= limit for m, _, limit in self.limits)

    def met(self, figures: Mapping[str, Any]) -> bool | None:
        """Do a run's percentiles (its figures, by their names) meet every limit? None when
        a figure is missing."""
        checks = [figures.get(f"p{p}_{FIGURE_NAMES[m]}_ms") for m, p, _ in self.limits]
        if any(c is None for c in checks):
            return None
        return all(c <= 1000 * limit for c, (_, _, limit) in zip(checks, self.limits))

    def limit(self, metric: str) -> float | None:
        """The first limit on `metric` (seconds), whatever its percentile."""
        return next((limit for m, _, limit in self.limits if m == metric), None)


def parse_slo(text: str | None) -> Slo | None:
    """--slo's value, or no SLO."""
    return Slo.parse(text) if text else None
