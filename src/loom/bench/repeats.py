"""Repeats you can trust: K runs of each point, their medians, a bootstrap 95% confidence
interval per figure, and whether a difference between two configurations lies outside the
noise.

The repeat is the unit of independence (a fresh server, or one whose prefix cache was reset),
so the interval is over the K per-repeat figures, not over the requests inside them: requests
of one run share its machine state and are not independent draws. The median of K values is
resampled with replacement (a fixed seed, so the same figures give the same interval); for
two configurations the difference of their medians is resampled the same way, and a
difference whose interval holds 0 is noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from loom.workload.figures import per_class, request_figures
from loom.workload.jsonview import JsonView
from loom.workload.results import RunResult, SweepResult, as_runs, as_sweep
from loom.workload.slo import Slo

# The figures a scorecard cell shows with its interval; "higher" says which way is better.
FIGURES: dict[str, bool] = {
    "request_throughput": True, "output_throughput": True, "request_goodput": True,
    "median_ttft_ms": False, "p95_ttft_ms": False, "p95_itl_ms": False,
    "mean_tpot_ms": False, "p95_e2el_ms": False, "error_rate": False}
RESAMPLES = 2000
LEVEL = 0.95


def bootstrap_ci(values: list[float], seed: int = 0) -> tuple[float, float]:
    """95% interval of the median of `values` by the percentile bootstrap."""
    x = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(x, size=(RESAMPLES, len(x)), replace=True), axis=1)
    tail = 100 * (1 - LEVEL) / 2
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def difference_ci(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float]:
    """95% interval of median(b) - median(a), each side resampled on its own."""
    rng = np.random.default_rng(seed)
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    diffs = (np.median(rng.choice(xb, size=(RESAMPLES, len(xb))), axis=1)
             - np.median(rng.choice(xa, size=(RESAMPLES, len(xa))), axis=1))
    tail = 100 * (1 - LEVEL) / 2
    return float(np.percentile(diffs, tail)), float(np.percentile(diffs, 100 - tail))


def aggregate(runs: Sequence[RunResult | Mapping[str, Any]],
              slo: Slo | None = None) -> RunResult:
    """One run result standing for K repeats of the same point: counts over all their
    requests, each figure of FIGURES the median of the repeats' with its interval in `ci`,
    the per-repeat figures in `repeat_figures`, the first repeat's timeline."""
    runs = as_runs(runs)
    if len(runs) == 1:
        return runs[0]
    requests = [r for run in runs for r in run.requests]
    total = sum(run.duration for run in runs)
    medians, ci = {}, {}
    for key in FIGURES:
        values = [v for run in runs if (v := run.figures.get(key)) is not None]
        if values:
            medians[key] = float(np.median(values))
            ci[key] = list(bootstrap_ci(values))
    preemptions = [p for run in runs if (p := run.metrics.preemptions) is not None]
    peaks = [p for run in runs if (p := run.metrics.kv_cache_usage.peak) is not None]
    kv = replace(runs[0].metrics.kv_cache_usage, peak=max(peaks) if peaks else None)
    metrics = replace(runs[0].metrics, preemptions=sum(preemptions) if preemptions else None,
                      kv_cache_usage=kv)
    client = next((run.client for run in runs if run.client.limited), runs[0].client)
    return replace(runs[0], figures=request_figures(requests, total, slo).replaced(medians),
                   per_class=per_class(requests, total, slo), requests=requests,
                   duration=total, metrics=metrics, client=client, repeats=len(runs),
                   repeat_figures=[_figures(run) for run in runs], ci=ci)


def _figures(run: RunResult) -> dict[str, Any]:
    """What the scorecard and checklist read of one repeat."""
    return {"date": run.origin.date, "duration": run.duration, "completed": run.figures.completed,
            "num_prompts": run.figures.num_prompts, "preemptions": run.metrics.preemptions,
            **{key: run.figures.get(key) for key in FIGURES},
            "client_limited": run.client.limited}


def values_of(run: RunResult, key: str) -> list[float]:
    """The per-repeat values of a figure (one value for a run without repeats)."""
    if run.repeat_figures:
        return [f[key] for f in run.repeat_figures if f.get(key) is not None]
    value = run.figures.get(key)
    return [] if value is None else [value]


def merge_sweeps(sweeps: Sequence[SweepResult | Mapping[str, Any]],
                 slo: Slo | None = None) -> SweepResult:
    """K sweeps of one configuration -> one sweep whose runs aggregate each point's repeats
    (a point that only some repeats reached aggregates those)."""
    sweeps = [as_sweep(s) for s in sweeps]
    if len(sweeps) == 1:
        return sweeps[0]
    by_point: dict[tuple[Any, Any], list[RunResult]] = {}
    for s in sweeps:
        for run in s.runs:
            by_point.setdefault(run.point, []).append(run)
    runs = sorted((aggregate(group, slo) for group in by_point.values()),
                  key=lambda r: (r.max_concurrency or 0, r.rate_order))
    knees = [s.knee_rate for s in sweeps if s.knee_rate is not None]
    return replace(sweeps[0], runs=runs, repeats=len(sweeps),
                   knee_rate=float(np.median(knees)) if knees else None,
                   knee_rates=[s.knee_rate for s in sweeps])


@dataclass(frozen=True)
class Difference(JsonView):
    """One figure of one configuration against the first at the same point."""

    point: tuple[Any, Any]
    config: str
    baseline: str
    figure: str
    baseline_median: float
    median: float
    difference_ci: tuple[float, float]
    verdict: str  # "noise" (the interval holds 0), "better" or "worse"


def differences(groups: Sequence[tuple[str, Sequence[RunResult | Mapping[str, Any]]]]
                ) -> list[Difference]:
    """Each configuration against the first at the same points, figure by figure: the
    difference of medians, its interval, and "noise" when the interval holds 0 (needs
    repeats on both sides)."""
    if len(groups) < 2:
        return []
    base_name, base_runs = groups[0][0], as_runs(groups[0][1])
    out = []
    for name, runs in groups[1:]:
        for run in as_runs(runs):
            base = next((b for b in base_runs if b.point == run.point), None)
            if base is None:
                continue
            for key, higher in FIGURES.items():
                a, b = values_of(base, key), values_of(run, key)
                if len(a) < 2 or len(b) < 2:
                    continue
                low, high = difference_ci(a, b)
                better = (float(np.median(b)) > float(np.median(a))) == higher
                verdict = "noise" if low <= 0 <= high else ("better" if better else "worse")
                out.append(Difference(run.point, name, base_name, key, float(np.median(a)),
                                      float(np.median(b)), (low, high), verdict))
    return out
