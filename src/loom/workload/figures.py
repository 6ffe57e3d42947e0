"""The figures of a set of requests: counts, throughputs, latency percentiles and goodput,
under `vllm bench serve`'s key names (so existing tooling reads them) plus loom's own.

Counting: every request sent is `completed` (status ok), `cancelled` (the client walked away,
as the trace asked), or `failed`; `rejected` (HTTP 503/429) is the part of `failed` that
admission control refused, `timeouts` the part that outlived --request-timeout. error_rate =
failed / num_prompts. Latency figures are over completed requests, in ms, like vLLM's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.workload.jsonview import JsonView
from loom.workload.requests import CANCELLED, OK, REJECTED, TIMEOUT, RequestResult
from loom.workload.slo import Slo

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")  # vLLM's names: e2el is end-to-end latency
# what a request class's own figures keep (per_class): does one class pay for another?
CLASS_KEYS = ("num_prompts", "completed", "failed", "rejected", "timeouts", "cancelled",
              "error_rate", "request_throughput", "output_throughput", "mean_ttft_ms",
              "median_ttft_ms", "p95_ttft_ms", "mean_tpot_ms", "p95_tpot_ms", "p95_itl_ms",
              "median_e2el_ms", "p95_e2el_ms", "request_goodput")


@dataclass(frozen=True)
class Latency:
    """One latency over a set of requests, in ms (None: no value to take). A run's own
    requests have vLLM's statistics (mean, median, std, percentiles); a server's summary of
    its own latencies (a histogram's estimate, or a simulation's exact values) has count,
    mean and percentiles."""

    mean: float | None = None
    percentiles: dict[int, float | None] = field(default_factory=dict)  # PERCENTILES
    median: float | None = None
    count: int | None = None
    std: float | None = None

    @classmethod
    def of(cls, values_s: list[float]) -> Latency:
        if not values_s:
            return cls(count=0)
        ms = np.asarray(values_s) * 1000.0
        return cls(float(ms.mean()), dict(zip(PERCENTILES, map(float, np.percentile(
            ms, PERCENTILES)))), float(np.median(ms)), len(values_s), float(ms.std()))

    @property
    def p95(self) -> float | None:
        return self.percentiles.get(95)

    def to_json(self, metric: str) -> dict[str, float | None]:
        """A run figure's `{stat}_{metric}_ms` keys, as vLLM writes them."""
        out = {f"{stat}_{metric}_ms": value for stat, value in (
            ("mean", self.mean), ("median", self.median), ("std", self.std))}
        return {**out, **{f"p{p}_{metric}_ms": self.percentiles.get(p) for p in PERCENTILES}}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], metric: str) -> Latency:
        return cls(obj.get(f"mean_{metric}_ms"), _percentiles(obj, f"_{metric}_ms"),
                   obj.get(f"median_{metric}_ms"), std=obj.get(f"std_{metric}_ms"))

    def summary(self) -> dict[str, Any]:
        """A server-side summary's keys: count, mean_ms, p50_ms..."""
        return {"count": self.count or 0, "mean_ms": self.mean,
                **{f"p{p}_ms": self.percentiles.get(p) for p in PERCENTILES}}

    @classmethod
    def from_summary(cls, obj: Mapping[str, Any]) -> Latency:
        return cls(obj.get("mean_ms"), _percentiles(obj, "_ms"), count=obj.get("count", 0))


def _percentiles(obj: Mapping[str, Any], suffix: str) -> dict[int, float | None]:
    return {p: obj.get(f"p{p}{suffix}") for p in PERCENTILES}


@dataclass(frozen=True)
class Goodput(JsonView):
    """Requests within every limit of an SLO."""

    slo: str
    good: int
    request_goodput: float
    fraction: float
    slo_met: bool | None


@dataclass(frozen=True)
class Figures(JsonView):
    """Counts, throughputs, latency and goodput of a set of requests (see the module doc).
    A request class's figures (`CLASS_KEYS`) are the same, fewer of them filled."""

    num_prompts: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    ttft: Latency = field(default_factory=Latency)  # (to_json writes COUNTS first)
    timeouts: int = 0
    cancelled: int = 0
    error_rate: float = 0.0
    tpot: Latency = field(default_factory=Latency)
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    itl: Latency = field(default_factory=Latency)
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    total_token_throughput: float = 0.0
    e2el: Latency = field(default_factory=Latency)
    request_goodput: float | None = None
    goodput: Goodput | None = None

    COUNTS = ("num_prompts", "completed", "failed", "rejected", "timeouts", "cancelled",
              "error_rate", "total_input_tokens", "total_output_tokens", "request_throughput",
              "output_throughput", "total_token_throughput")

    def to_json(self, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
        """The flat figures (only `keys`, when given: a class's)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in self.COUNTS}
        for metric in LATENCIES:
            out.update(getattr(self, metric).to_json(metric))
        out["request_goodput"] = self.request_goodput
        out["goodput"] = self.goodput.to_json() if self.goodput else None
        return out if keys is None else {k: out[k] for k in keys}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Figures:
        """A run's (or a class's) figures; a figure the file lacks keeps its default."""
        counts = {k: obj[k] for k in cls.COUNTS if obj.get(k) is not None}
        goodput = obj.get("goodput")
        return cls(**counts, **{m: Latency.from_json(obj, m) for m in LATENCIES},
                   request_goodput=obj.get("request_goodput"),
                   goodput=Goodput.from_json(goodput) if goodput else None)

    def replaced(self, values: Mapping[str, float]) -> Figures:
        """These figures with some replaced, by their names (`p95_ttft_ms`)."""
        return Figures.from_json({**self.to_json(), **values})


def request_figures(results: list[RequestResult], duration_s: float,
                    slo: Slo | None) -> Figures:
    """Counts, throughputs, latency percentiles and goodput of a set of requests."""
    done = [r for r in results if r.status == OK]
    cancelled = sum(r.status == CANCELLED for r in results)
    failed = len(results) - len(done) - cancelled
    total_in = sum(r.prompt_len or 0 for r in done)
    total_out = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    figures = Figures(
        num_prompts=len(results), completed=len(done), failed=failed,
        rejected=sum(r.status == REJECTED for r in results),
        timeouts=sum(r.status == TIMEOUT for r in results), cancelled=cancelled,
        error_rate=failed / len(results) if results else 0.0,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(done) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=Latency.of([r.ttft_s for r in done]),
        tpot=Latency.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=Latency.of([x for r in done for x in r.itls_s]),
        e2el=Latency.of([r.e2e_s for r in done]))
    if slo is None:
        return figures
    good = sum(slo.good(r) for r in results)
    return Figures.from_json({**figures.to_json(), "request_goodput": good / duration_s,
                              "goodput": {"slo": str(slo), "good": good,
                                          "request_goodput": good / duration_s,
                                          "fraction": good / len(results) if results else 0.0,
                                          "slo_met": slo.met(figures)}})


def per_class(results: list[RequestResult], duration_s: float,
              slo: Slo | None) -> dict[str, Figures]:
    """The figures of each request class on its own: does one class pay for another?"""
    return {cls: Figures.from_json(request_figures(
        [r for r in results if r.cls == cls], duration_s, slo).to_json(CLASS_KEYS))
        for cls in sorted({r.cls for r in results})}


def offered_rate(results: list[RequestResult], duration_s: float) -> float:
    """Requests/s the client actually offered: sends over the span of sending, but never
    below sends over the run's duration, the span completed req/s is measured over; else a
    short run (n - 1 gaps in the span, n answers in the duration) would complete more
    requests per second than it was offered."""
    span = max((r.scheduled_s for r in results), default=0.0)
    overall = len(results) / max(duration_s, 1e-9)
    if len(results) > 1 and span > 0:
        return max((len(results) - 1) / span, overall)
    return overall
