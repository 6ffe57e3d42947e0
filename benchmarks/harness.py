"""The timing loops the benchmarks share, and the line each prints first.

Every figure in BENCHMARKS.md is a comparison measured on a shared machine whose speed drifts
by the minute: two kernels, two engines, two source trees, loom and a peer. What makes such a
figure worth quoting is the order it was taken in, not the clock: the calls being compared
take turns (`alternating`, `round_order`), each side gets its warm-up before anything is timed,
and a round's figures are compared with the same round's (`ratios`). A figure is quoted with
the host, the date and the commit it was measured at, which `host_line` prints.

Scripts in the sub-folders import this as `benchmarks.harness`, with the checkout on sys.path:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from loom import host

T = TypeVar("T")
K = TypeVar("K")

CHECKOUT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's commit (short hash, `+` if its tracked files differ from it), or
    "unknown" outside a git checkout."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=CHECKOUT,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=CHECKOUT,
                               capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+" if dirty else "")


def host_line() -> str:
    """`host: <loom.host.describe()>; <UTC date and time>; commit <hash>`: the provenance
    BENCHMARKS.md records with every figure, printed first by every benchmark."""
    return (f"host: {host.describe()}; {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; "
            f"commit {commit()}")


def timings(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_and_median(fn: Callable[[], Any], repeats: int, warmup: int = 1
                    ) -> tuple[float, float]:
    """(best, median) seconds of `fn` over `repeats` calls after `warmup` untimed ones. The
    best is what the code can do (other load only ever adds time); the median is what a
    caller sees."""
    times = timings(fn, repeats, warmup)
    return min(times), statistics.median(times)


def mean_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Mean seconds a call over `repeats` calls timed together, after `warmup` untimed ones:
    for calls too short for a timer each (tens of microseconds)."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def round_order(items: Sequence[T], round_: int) -> list[T]:
    """`items` in round `round_`'s order: as given in even rounds, reversed in odd ones, so
    that no side always runs right after another (and drift within a round is shared)."""
    return list(items) if round_ % 2 == 0 else list(reversed(items))


def alternating(calls: Sequence[Callable[[], float]], rounds: int = 6) -> list[float]:
    """Each timing call's median over `rounds` rounds, the calls taking turns in
    `round_order`."""
    times: list[list[float]] = [[] for _ in calls]
    for r in range(rounds):
        for i in round_order(range(len(calls)), r):
            times[i].append(calls[i]())
    return [statistics.median(t) for t in times]


def medians(runs: Mapping[K, Sequence[float]]) -> dict[K, float]:
    """The median of each side's rounds."""
    return {key: statistics.median(values) for key, values in runs.items()}


def ratios(after: Sequence[float], before: Sequence[float]) -> str:
    """after / before round by round, `1.021, 0.998`: how far the rounds agree."""
    return ", ".join(f"{a / b:.3f}" for a, b in zip(after, before))
