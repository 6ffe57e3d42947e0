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

import math
from typing import Any

import numpy as np

from loom.bench.results import Slo, per_class, request_figures, requests_of

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


def aggregate(runs: list[dict[str, Any]], slo: Slo | None = None) -> dict[str, Any]:
    """One run result standing for K repeats of the same point: counts over all their
    requests, each figure of FIGURES the median of the repeats' with its interval in `ci`,
    the per-repeat figures in `repeat_figures`, the first repeat's timeline."""
    if len(runs) == 1:
        return runs[0]
    requests = [r for run in runs for r in requests_of(run)]
    total = sum(run["duration"] for run in runs)
    out = {**runs[0], **request_figures(requests, total, slo)}
    out["per_class"] = per_class(requests, total, slo)
    out["requests"] = [r for run in runs for r in run["requests"]]
    out["duration"] = total
    out["repeats"] = len(runs)
    out["repeat_figures"] = [_figures(run) for run in runs]
    out["ci"] = {}
    for key in FIGURES:
        values = [run[key] for run in runs if run.get(key) is not None]
        if values:
            out[key] = float(np.median(values))
            out["ci"][key] = list(bootstrap_ci(values))
    preemptions = [run["preemptions"] for run in runs if run.get("preemptions") is not None]
    out["preemptions"] = sum(preemptions) if preemptions else None
    peaks = [run["kv_cache_usage_peak"] for run in runs
             if run.get("kv_cache_usage_peak") is not None]
    out["kv_cache_usage_peak"] = max(peaks) if peaks else None
    limited = [run for run in runs if (run.get("client") or {}).get("limited")]
    if limited:
        out["client"] = limited[0]["client"]
    return out


def _figures(run: dict[str, Any]) -> dict[str, Any]:
    keep = ("date", "duration", "completed", "num_prompts", "preemptions", *FIGURES)
    out = {k: run.get(k) for k in keep}
    out["client_limited"] = bool((run.get("client") or {}).get("limited"))
    return out


def values_of(run: dict[str, Any], key: str) -> list[float]:
    """The per-repeat values of a figure (one value for a run without repeats)."""
    if run.get("repeat_figures"):
        return [f[key] for f in run["repeat_figures"] if f.get(key) is not None]
    return [run[key]] if run.get(key) is not None else []


def point(run: dict[str, Any]) -> tuple[Any, Any]:
    return run["request_rate"], run.get("max_concurrency")


def merge_sweeps(sweeps: list[dict[str, Any]], slo: Slo | None = None) -> dict[str, Any]:
    """K sweeps of one configuration -> one sweep whose runs aggregate each point's repeats
    (a point that only some repeats reached aggregates those)."""
    if len(sweeps) == 1:
        return sweeps[0]
    by_point: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for s in sweeps:
        for run in s["runs"]:
            by_point.setdefault(point(run), []).append(run)
    runs = [aggregate(group, slo) for group in by_point.values()]
    runs.sort(key=lambda r: (r["max_concurrency"] or 0, _rate(r)))
    knees = [s["knee_rate"] for s in sweeps if s.get("knee_rate") is not None]
    return {**sweeps[0], "runs": runs, "repeats": len(sweeps),
            "knee_rate": float(np.median(knees)) if knees else None,
            "knee_rates": [s.get("knee_rate") for s in sweeps]}


def _rate(run: dict[str, Any]) -> float:
    rate = run["request_rate"]
    return rate if isinstance(rate, (int, float)) else math.inf


def differences(groups: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Each configuration against the first at the same points, figure by figure: the
    difference of medians, its interval, and "noise" when the interval holds 0 (needs
    repeats on both sides)."""
    if len(groups) < 2:
        return []
    base_name, base_runs = groups[0]
    out = []
    for name, runs in groups[1:]:
        for run in runs:
            base = next((b for b in base_runs if point(b) == point(run)), None)
            if base is None:
                continue
            for key, higher in FIGURES.items():
                a, b = values_of(base, key), values_of(run, key)
                if len(a) < 2 or len(b) < 2:
                    continue
                low, high = difference_ci(a, b)
                better = (float(np.median(b)) > float(np.median(a))) == higher
                verdict = "noise" if low <= 0 <= high else ("better" if better else "worse")
                out.append({"point": point(run), "config": name, "baseline": base_name,
                            "figure": key, "baseline_median": float(np.median(a)),
                            "median": float(np.median(b)), "difference_ci": [low, high],
                            "verdict": verdict})
    return out
