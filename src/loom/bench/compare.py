"""`loom bench compare`: change one setting at a time, on one trace.

Each configuration is measured its own way (`Measure`): by default a fresh server is started
(loom, or any command line with a {port} via --server-cmd), swept over the same offered
loads on the same trace, and stopped; the simulator measures a configuration given as
`simulate:FLAGS` (sim/measure.py implements the same protocol, so bench never imports the
simulator). The directory then holds one sweep JSON per configuration, compare.json indexing
them, the scorecard and the plots. The default pair is continuous batching against the
fixed-batch baseline (`--scheduler static`) on the same model, trace and hardware.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from loom.bench.plots import plot_sweeps, plot_timeline
from loom.bench.repeats import merge_sweeps
from loom.bench.replay import Target
from loom.bench.scorecard import markdown
from loom.bench.server import LocalServer
from loom.bench.sweep import sweep
from loom.workload.results import (
    CompareEntry,
    CompareResult,
    ConfigInfo,
    SweepResult,
    save_json,
)
from loom.workload.slo import Slo
from loom.workload.sweeps import SweepSpec
from loom.workload.trace import Trace

DEFAULT_CONFIGS = [("continuous", ""), ("static", "--scheduler static")]
SIMULATE = "simulate:"  # --config NAME=simulate:<loom simulate flags>


def parse_config(text: str) -> tuple[str, str]:
    """NAME=FLAGS, e.g. "budget-2k=--max-num-batched-tokens 2048", or NAME=simulate:FLAGS
    for `loom simulate FLAGS` in place of a server."""
    name, sep, flags = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"bad --config {text!r}; use NAME='--flag value ...' (NAME: letters, "
                         "digits, _ . -)")
    return name, flags


class Measure(Protocol):
    """How one configuration of a comparison is measured. `flags` is the configuration as
    it was given (compare.json records it); `repeatable` is False for what gives the same
    figures every time (the simulator), which is then measured once whatever --repeats."""

    flags: str
    repeatable: bool

    def check(self, name: str, spec: SweepSpec) -> None:
        """Refuse what it cannot measure, before any configuration runs."""

    def sweep(self, name: str, trace: Trace, spec: SweepSpec, log: Path) -> SweepResult:
        """One sweep of the configuration (`log`: where a server's output goes)."""


@dataclass
class ServerMeasure:
    """A fresh server per sweep (so no prefix cache or warm state carries over):
    `server_cmd` with {port}, `flags` appended; `target` holds the Target options every
    server shares (scrape interval, request timeout, endpoint)."""

    server_cmd: str
    flags: str = ""
    target: dict[str, Any] = field(default_factory=dict)
    health_timeout_s: float = 600.0
    progress: bool = True
    repeatable: bool = True

    def check(self, name: str, spec: SweepSpec) -> None:
        """A server is checked as it starts."""

    def sweep(self, name: str, trace: Trace, spec: SweepSpec, log: Path) -> SweepResult:
        with LocalServer(self.server_cmd, self.flags, log, self.health_timeout_s) as server:
            target = Target(server.url, server_pid=server.pid, **self.target)
            result = asyncio.run(sweep(trace, spec.load, target, spec.limits, spec.rates,
                                       spec.concurrencies, spec.auto, spec.slo, name,
                                       self.progress))
        return replace(result, config=ConfigInfo(name, self.flags, shlex.join(server.command)))


def compare(trace: Trace, configs: Sequence[tuple[str, Measure]], spec: SweepSpec,
            out_dir: Path, repeats: int = 1, gpu_cost_per_hour: float | None = None,
            command: str | None = None) -> CompareResult:
    """Sweep every configuration `repeats` times, interleaved (A B A B: a drift of the
    machine hits both alike); what is not `repeatable` runs once. Each configuration's
    repeats are merged point by point (repeats.py). Every configuration is checked before
    the first runs: a sweep thrown away for a later one's bad flag is minutes lost.
    `command`, the command line that asked for the comparison, is recorded in its files."""
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if len({name for name, _ in configs}) != len(configs):
        raise ValueError("configuration names must differ")
    for name, measure in configs:
        measure.check(name, spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[SweepResult]] = {name: [] for name, _ in configs}
    for k in range(repeats):
        for name, measure in configs:
            if k and not measure.repeatable:
                continue
            log = out_dir / (f"{name}.server.log" if repeats == 1
                             else f"{name}.repeat{k + 1}.server.log")
            results[name].append(measure.sweep(name, trace, spec, log))
    entries, sweeps = [], []
    for name, _ in configs:
        merged = merge_sweeps(results[name], spec.slo).with_command(command)
        save_json(merged, out_dir / f"{name}.json")
        entries.append(CompareEntry(name, f"{name}.json", merged.flags, merged.knee_rate,
                                    merged.simulated))
        sweeps.append(merged)
    return save_compare(trace, entries, sweeps, out_dir, spec.slo, gpu_cost_per_hour, command)


def save_compare(trace: Trace, entries: list[CompareEntry], sweeps: list[SweepResult],
                 out_dir: Path, slo: Slo | None, gpu_cost_per_hour: float | None,
                 command: str | None) -> CompareResult:
    """compare.json indexing the sweeps already saved as entries' files, plus the report.
    Measured and simulated configurations (`loom simulate --gpus ...`) share this layout, so
    `loom bench scorecard DIR` and `loom diagnose DIR` read either."""
    result = CompareResult(entries, sweeps, trace.describe(), command)
    save_json(result.index(), out_dir / "compare.json")
    write_report(sweeps, out_dir, slo, gpu_cost_per_hour)
    return result


def write_report(sweeps: list[SweepResult], out_dir: Path, slo: Slo | None,
                 gpu_cost_per_hour: float | None) -> list[Path]:
    """scorecard.md, throughput.png, latency.png and one timeline per configuration."""
    runs = [run for s in sweeps for run in s.runs]
    groups = [(s.label, s.runs) for s in sweeps]
    (out_dir / "scorecard.md").write_text(markdown(runs, slo, gpu_cost_per_hour, groups=groups))
    series = {s.label: s.runs for s in sweeps}
    paths = plot_sweeps(series, out_dir)
    for name, runs_of_config in series.items():
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        path = plot_timeline(name, runs_of_config, out_dir / f"timeline-{safe}.png")
        if path:
            paths.append(path)
    return paths
