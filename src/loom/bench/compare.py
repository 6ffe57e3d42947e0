"""`loom bench compare`: change one setting at a time, on one trace.

For each configuration a fresh server is started (loom by default; any command line with a
{port} via --server-cmd), swept over the same offered loads on the same trace, and stopped;
the directory then holds one sweep JSON per configuration, compare.json indexing them, the
scorecard and the plots. The default pair is continuous batching against the fixed-batch
baseline (`--scheduler static`) on the same model, trace and hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loom.bench.plots import plot_sweeps, plot_timeline
from loom.bench.repeats import merge_sweeps
from loom.bench.replay import Load, Target
from loom.bench.results import Slo, load_json, save_json
from loom.bench.scorecard import markdown
from loom.bench.server import LocalServer
from loom.bench.sweep import AutoSearch, Limits, sweep
from loom.bench.trace import Trace

DEFAULT_CONFIGS = [("continuous", ""), ("static", "--scheduler static")]


def parse_config(text: str) -> tuple[str, str]:
    """NAME=FLAGS, e.g. "budget-2k=--max-num-batched-tokens 2048", or NAME=simulate:FLAGS
    for `loom simulate FLAGS` in place of a server."""
    name, sep, flags = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"bad --config {text!r}; use NAME='--flag value ...' (NAME: letters, "
                         "digits, _ . -)")
    return name, flags


SIMULATE = "simulate:"  # --config NAME=simulate:<loom simulate flags>


def compare(trace: Trace, configs: list[tuple[str, str]], out_dir: Path, base: Load,
            limits: Limits, server_cmd: str, common_flags: str = "",
            rates: list[float] | None = None, concurrencies: list[int] | None = None,
            auto: AutoSearch | None = None, slo: Slo | None = None,
            gpu_cost_per_hour: float | None = None,
            target_options: Mapping[str, Any] | None = None,
            health_timeout_s: float = 600.0, progress: bool = True,
            repeats: int = 1) -> dict[str, Any]:
    """Sweep every configuration `repeats` times, interleaved (A B A B: a drift of the
    machine hits both alike), each repeat on a freshly started server (so no prefix cache or
    warm state carries over); a simulated configuration (`simulate:` flags) runs once, being
    deterministic. Each configuration's repeats are merged point by point (repeats.py).
    `target_options`: the Target fields for every server (scrape interval, request timeout,
    endpoint)."""
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    for name, flags in configs:  # before any server runs: its sweep would be thrown away
        if flags.startswith(SIMULATE):
            _check_simulated(name, trace, base, auto)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    for k in range(repeats):
        for name, flags in configs:
            if flags.startswith(SIMULATE):
                if k == 0:
                    results[name].append(simulate_config(
                        name, flags[len(SIMULATE):], trace, out_dir, base, rates,
                        concurrencies, auto, slo))
                continue
            all_flags = f"{common_flags} {flags}".strip()
            log = out_dir / (f"{name}.server.log" if repeats == 1
                             else f"{name}.repeat{k + 1}.server.log")
            with LocalServer(server_cmd, all_flags, log, health_timeout_s) as server:
                target = Target(server.url, server_pid=server.pid,
                                **(target_options or {}))
                result = asyncio.run(sweep(trace, base, target, limits, rates, concurrencies,
                                           auto, slo, name, progress))
            result["config"] = {"name": name, "flags": all_flags,
                                "server_command": shlex.join(server.command)}
            results[name].append(result)
    entries, sweeps = [], []
    for name, _ in configs:
        result = merge_sweeps(results[name], slo)
        save_json(result, out_dir / f"{name}.json")
        entries.append({"name": name, "flags": result["config"]["flags"],
                        "file": f"{name}.json", "knee_rate": result["knee_rate"],
                        **({"simulated": True} if result.get("simulated") else {})})
        sweeps.append(result)
    return save_compare(trace, entries, sweeps, out_dir, slo, gpu_cost_per_hour)


def simulate_config(name: str, flags: str, trace: Trace, out_dir: Path, base: Load,
                    rates: list[float] | None, concurrencies: list[int] | None,
                    auto: AutoSearch | None, slo: Slo | None) -> dict[str, Any]:
    """`loom simulate FLAGS` on the same trace and loads: a sweep JSON marked simulated."""
    from loom.sim.cli import add_parser  # the simulator only when asked for

    _check_simulated(name, trace, base, auto)
    sim_dir = out_dir / f"{name}.simulated"
    argv = ["simulate", "--trace", trace.path, "--label", name, "--output-dir", str(sim_dir),
            "--seed", str(base.seed), "--burstiness", str(base.burstiness)]
    if rates is not None:
        argv += ["--rates", ",".join(f"{r:g}" for r in rates)]
    if concurrencies is not None:
        argv += ["--overlap", ",".join(map(str, concurrencies))]
    for flag, value in (("--max-concurrency", base.max_concurrency),
                        ("-n", base.num_requests), ("--duration", base.duration_s),
                        ("--slo", slo)):
        if value is not None:
            argv += [flag, str(value)]
    parser = argparse.ArgumentParser(prog="loom")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv + shlex.split(flags))
    args.func(args)
    simulated = _simulated_config(name, sim_dir)
    result = load_json(sim_dir / simulated["file"])
    _rename(result, simulated["name"], name)
    result["config"]["flags"] = f"{SIMULATE}{flags}"
    return result


def _check_simulated(name: str, trace: Trace, base: Load, auto: AutoSearch | None) -> None:
    """What `loom simulate` cannot take from a comparison."""
    if auto is not None or base.burst or base.ramp_up:
        raise ValueError(f"--config {name}=simulate:...: the simulator takes --rates or "
                         "--overlap, without --auto, --burst or --ramp-up")
    if trace.path is None:
        raise ValueError("a simulated configuration needs the trace as a file")


def _simulated_config(name: str, sim_dir: Path) -> dict[str, Any]:
    """The configuration `loom simulate` wrote (its name and sweep file): it names it after
    --label with --profile, but after the GPU and TP (h100-sxm-tp1) with --gpus, so its
    compare.json is read."""
    configs = load_json(sim_dir / "compare.json")["configs"]
    if len(configs) != 1:
        names = ", ".join(c["name"] for c in configs)
        raise ValueError(f"--config {name}=simulate:...: simulated {len(configs)} "
                         f"configurations ({names}); give one per --config (one GPU, one "
                         "tensor-parallel size)")
    return configs[0]


def _rename(result: dict[str, Any], simulated: str, name: str) -> None:
    """The sweep and its runs under the comparison's NAME. With --gpus the simulator names
    its runs after the GPU ("simulated h100-sxm-tp1 @2/s"); left so, the scorecard would
    call the configuration that while its timeline and fairness rows call it NAME."""
    result["label"] = name
    for run in result["runs"]:
        run["label"] = run["label"].replace(f"simulated {simulated}", f"simulated {name}", 1)


def save_compare(trace: Trace, entries: list[dict[str, Any]], sweeps: list[dict[str, Any]],
                 out_dir: Path, slo: Slo | None, gpu_cost_per_hour: float | None
                 ) -> dict[str, Any]:
    """compare.json indexing the sweeps already saved as entries' files, plus the report.
    Measured and simulated configurations (`loom simulate --gpus ...`) share this layout, so
    `loom bench scorecard DIR` and `loom diagnose DIR` read either."""
    index = {"kind": "compare", "command": shlex.join(sys.argv), "trace": trace.describe(),
             "configs": entries}
    save_json(index, out_dir / "compare.json")
    write_report(sweeps, out_dir, slo, gpu_cost_per_hour)
    index["sweeps"] = sweeps
    return index


def write_report(sweeps: list[dict[str, Any]], out_dir: Path, slo: Slo | None,
                 gpu_cost_per_hour: float | None) -> list[Path]:
    """scorecard.md, throughput.png, latency.png and one timeline per configuration."""
    runs = [run for s in sweeps for run in s["runs"]]
    groups = [(s["label"], s["runs"]) for s in sweeps]
    (out_dir / "scorecard.md").write_text(markdown(runs, slo, gpu_cost_per_hour, groups=groups))
    series = {s["label"]: s["runs"] for s in sweeps}
    paths = plot_sweeps(series, out_dir)
    for name, runs_of_config in series.items():
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        path = plot_timeline(name, runs_of_config, out_dir / f"timeline-{safe}.png")
        if path:
            paths.append(path)
    return paths

