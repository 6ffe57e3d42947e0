"""PNG plots of sweeps: throughput and p95 latency against offered load, one line per
configuration, and a timeline of running / waiting / KV usage from the /metrics scrapes."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in tests

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from loom.workload.results import RunResult  # noqa: E402

Series = dict[str, list[RunResult]]  # configuration -> its runs
Value = Callable[[RunResult], float | None]


def _x(run: RunResult) -> float:
    """The load axis: configured rate, else concurrency (closed loop), else measured rate."""
    rate = run.request_rate
    if isinstance(rate, (int, float)) and math.isfinite(rate):
        return rate
    if run.closed_loop and run.max_concurrency:
        return run.max_concurrency
    return run.offered_rate


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _x_label(series: Series) -> str:
    runs = [r for rs in series.values() for r in rs]
    if all(r.closed_loop and r.max_concurrency for r in runs):
        return "concurrent requests (closed loop)"
    return "offered load (req/s)"


def _lines(ax: Any, series: Series, value: Value, ylabel: str) -> None:
    for name, runs in series.items():
        points = sorted((_x(r), value(r)) for r in runs if value(r) is not None)
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_sweeps(series: Series, out_dir: Path) -> list[Path]:
    """throughput.png and latency.png for {configuration name: its runs}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    xlabel = _x_label(series)
    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    _lines(ax1, series, lambda r: r.figures.request_throughput, "completed req/s")
    _lines(ax2, series, lambda r: r.figures.output_throughput, "output tok/s")
    if xlabel.startswith("offered"):
        top = max((_x(r) for rs in series.values() for r in rs), default=1)
        ax1.plot([0, top], [0, top], ls=":", color="grey", label="offered")
    fig.suptitle("Throughput vs offered load")
    paths.append(_save(fig, (ax1, ax2), xlabel, out_dir / "throughput.png"))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    _lines(ax1, series, lambda r: _seconds(r.figures.ttft.p95), "p95 TTFT (s)")
    _lines(ax2, series, lambda r: _seconds(r.figures.e2el.p95), "p95 end-to-end (s)")
    fig.suptitle("Tail latency vs offered load")
    paths.append(_save(fig, (ax1, ax2), xlabel, out_dir / "latency.png"))
    return paths


def plot_timeline(name: str, runs: list[RunResult], path: Path) -> Path | None:
    """Running, waiting (and the client's in-flight count) and KV usage over a sweep's runs,
    laid end to end; None when no run has a timeline."""
    if not any(r.timeline for r in runs):
        return None
    fig, axes = plt.subplots(3, 1, figsize=(11, 7), sharex=True)
    offset = 0.0
    for run in runs:
        timeline = run.timeline
        t = [offset + e["t"] for e in timeline]
        for ax, key, label in ((axes[0], "running", "running"),
                               (axes[0], "client_in_flight", "client in flight"),
                               (axes[1], "waiting", "waiting"), (axes[2], "kv_usage", "KV usage")):
            values = [e.get(key) for e in timeline]
            if any(v is not None for v in values):
                ax.plot(t, [math.nan if v is None else v for v in values],
                        label=label if run is runs[0] else None,
                        color={"running": "C0", "client_in_flight": "C7", "waiting": "C1",
                               "kv_usage": "C2"}[key])
        axes[0].axvline(offset, color="grey", lw=0.5)
        axes[0].annotate(run.label or "", (offset, 1), xycoords=("data", "axes fraction"),
                         fontsize=7, rotation=90, va="top")
        offset += max([e["t"] for e in timeline], default=run.duration) + 1.0
    axes[0].set_ylabel("requests")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[1].set_ylabel("waiting")
    axes[2].set_ylabel("KV cache usage")
    axes[2].set_xlabel("seconds (runs laid end to end)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"Server state over time: {name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _save(fig: Any, axes: tuple[Any, ...], xlabel: str, path: Path) -> Path:
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_fairness(slowdowns: dict[str, dict[str, float]], path: Path) -> Path | None:
    """Mean slowdown (E2E / ideal) per request class, one group of bars per configuration;
    None when there is nothing to plot."""
    classes = sorted({c for per_class in slowdowns.values() for c in per_class})
    if not classes:
        return None
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / max(len(slowdowns), 1)
    for i, (name, per_class) in enumerate(slowdowns.items()):
        xs = [j + i * width for j in range(len(classes))]
        ax.bar(xs, [per_class.get(c, math.nan) for c in classes], width, label=name)
    ax.set_xticks([j + width * (len(slowdowns) - 1) / 2 for j in range(len(classes))], classes)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_ylabel("mean slowdown (E2E / ideal)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Who waits: slowdown per request class")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
