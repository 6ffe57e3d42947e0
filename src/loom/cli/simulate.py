"""`loom simulate` (the real scheduler on a virtual clock) and `loom simulate calibrate`.

Only argparse and the flag helpers are imported at module level; the work is imported inside
the command, so `loom --help` stays fast. Only `calibrate` loads torch and the model.
"""

from __future__ import annotations

import argparse
import logging
import math
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from loom.admission import AdmissionConfig
from loom.cli.dataclass_flags import add_engine_args, engine_config, from_cli_args
from loom.cli.flags import (
    Report,
    Tokenizer,
    add_command,
    add_flags,
    check_folder_writable,
    check_writable,
    command_line,
    opt,
    option,
    overlap,
)
from loom.cli.main import help_of
from loom.cli.plan import model_help
from loom.config import flag_help
from loom.plan.planner import PlanFlags, csv_ints
from loom.workload.load import Load
from loom.workload.results import CompareEntry, Limits, RunResult, SweepResult, save_json
from loom.workload.slo import Slo
from loom.workload.trace import Trace

if TYPE_CHECKING:
    from loom.sim.configs import SimSetup
    from loom.sim.measure import SimulatedMeasure
    from loom.sim.result import SimConfig

USAGE = """%(prog)s (--profile PROFILE | --gpus GPUS --model MODEL) --trace TRACE
                     (--rate RATE | --max-concurrency N | --overlap LIST) [options]
       %(prog)s calibrate --output PROFILE [options]"""
LOAD = ("burstiness", "max_concurrency", "duration_s", "num_requests", "seed")


def sim_rates(text: str) -> tuple[float | str, ...]:
    """'0.5,1,inf,trace' -> rates; 'trace' replays the trace's own arrival_s (each is
    checked to be > 0 with the other flags, before anything runs)."""
    out: list[float | str] = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            out.append(x if x == "trace" else math.inf if x == "inf" else float(x))
        except ValueError:
            raise ValueError(f"{x!r} is not a rate: give requests per second, inf or "
                             "trace") from None
    return tuple(out)


def routers(text: str) -> tuple[str, ...]:
    from loom.cluster.routing import ROUTERS

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in ROUTERS]
    if unknown or not names:
        raise ValueError(f"unknown router {', '.join(unknown) or text!r}; choose from "
                         f"{', '.join(ROUTERS)}")
    return names


def engine_name(text: str) -> str:
    from loom.plan.fitted import check_engine

    check_engine(text)
    return text


@dataclass(frozen=True)
class SetupFlags:
    """Which server is simulated, besides its engine and admission flags."""

    CLI_GROUP = "Simulated server"

    profile: str | None = opt(None,
        "step profile JSON (loom simulate calibrate); none = a roofline profile per --gpus")
    label: str | None = opt(None, "name of the configuration; default: the profile's file name")
    replicas: tuple[int, ...] = field(default=(1,), metadata=flag_help(
        "fleet: engines behind a router, as loom serve --data-parallel-size runs them; a "
        "list (e.g. 10,100) simulates each size", parse=csv_ints))
    router: tuple[str, ...] = field(default=("prefix",), metadata=flag_help(
        "fleet routing policy: prefix, pow2 or round-robin; a list simulates each",
        parse=routers))
    serving_engine: str = opt("vllm",
        "--gpus what-if: whose published behaviour the step model is fitted to (vllm, "
        "trtllm or sglang; fitted_profiles.json); --efficiency overrides it",
        flag="--engine", parse=engine_name)


@dataclass(frozen=True)
class SimFlags:
    """The trace, its loads and what is written."""

    CLI_GROUP = "Simulation"

    trace: str | None = opt(None, "JSONL trace (see loom bench trace); required (no default)")
    rates: tuple[float | str, ...] | None = field(default=None, metadata={**flag_help(
        "offered req/s ('inf': all at once, 'trace': arrival_s as recorded); a list (e.g. "
        "0.5,1,2,4) runs a sweep; give it, --max-concurrency or --overlap (no default)",
        flag="--rate", parse=sim_rates), "aliases": ("--rates",)})
    overlap: tuple[int, ...] | None = overlap()
    scrape_interval_s: float = opt(1.0,
        "simulated seconds between timeline samples", flag="--scrape-interval")
    output: str | None = opt(None, "result JSON (one profile, one load); default: none written")
    output_dir: str | None = opt(None,
        "several loads or configurations: sweep JSONs, compare.json, scorecard.md and "
        "plots, as loom bench compare writes them; required then (no default)")

    def __post_init__(self) -> None:
        """The ranges, before any work: out of range, a run sends no request (or fails them
        all) and would still exit 0."""
        if not self.trace:
            raise ValueError("loom simulate needs --trace (or the calibrate sub-command)")
        if not self.scrape_interval_s > 0:
            raise ValueError(f"--scrape-interval must be > 0, got {self.scrape_interval_s:g}")
        bad_rates = [r for r in self.rates or () if r != "trace" and not r > 0]
        if bad_rates:
            raise ValueError(f"--rate must be > 0 (or inf, or trace), got {bad_rates[0]:g}")


@dataclass(frozen=True)
class CalibrateFlags:
    CLI_GROUP = "Calibration"

    calibrate_output: str | None = opt(None,
        "profile JSON to write; required without --published (default with it: the "
        "package's fitted_profiles.json)", flag="--output")
    published: bool = opt(False,
        "fit the GPU step model to the published measurements (loom/plan/published.json) "
        "instead of timing this machine")
    grid: Literal["quick", "default"] = opt("default",
        "quick: a smoke run in seconds; default: a few minutes on 2 cores")
    repeats: int = opt(3, "timed steps per grid point")
    served: str | None = opt(None,
        "offline PROFILE: add what `loom serve` costs on top of it, measured against a real "
        "server on loopback (closed loops of 1 and 16 users), and write --output (default: "
        "none, time the offline engine)")


def _setup_flags(p: argparse.ArgumentParser) -> None:
    """What a simulated server is: a profile or GPUs, its engine, admission and fleet."""
    add_flags(p, SetupFlags)
    add_flags(p, AdmissionConfig)
    add_flags(p, PlanFlags, only=PlanFlags.GPU_FIELDS)
    option(p, "--gpus").help = ("what-if: simulate each of these GPUs (roofline profiles from "
                                "the catalogue, KV capacity from loom plan) with --model; none "
                                "= --profile")
    add_engine_args(p)
    option(p, "--model").help = model_help("the bundled model; with --profile: the model it "
                                           "was calibrated on")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "simulate", main, SimFlags, Tokenizer, (Load, LOAD), (Report, ("slo",)), Limits,
        _setup_flags, short={"num_requests": "-n"}, usage=USAGE, help=help_of("simulate"),
        description="Drive loom's real scheduler and KV cache with a step-time profile on a "
                    "virtual clock; writes loom bench's result JSON marked simulated. Profiles "
                    "come from `loom simulate calibrate` (this machine) or from the GPU "
                    "catalogue (--gpus, roofline).")
    subs = p.add_subparsers(dest="simulate_command", metavar="calibrate",
                            title="sub-command (optional)")
    add_command(subs, "calibrate", main, CalibrateFlags, add_engine_args,
                help="measure loom's engine here and fit a step profile",
                description="Time loom's engine offline on this machine over a grid of "
                            "prefill tokens x decode sequences x context, fit the "
                            "roofline-shaped step model and report its held-out error.")


def _setup(args: argparse.Namespace) -> SimSetup:
    from loom.sim.configs import SimSetup

    server = from_cli_args(SetupFlags, args)
    return SimSetup(engine_config(args), from_cli_args(AdmissionConfig, args),
                    server.profile, from_cli_args(PlanFlags, args), server.label,
                    server.replicas, server.router, server.serving_engine)


def measure(text: str, tokenizer: str | None, seed: int) -> SimulatedMeasure:
    """`--config NAME=simulate:FLAGS` of `loom bench compare`: FLAGS read as `loom simulate`
    reads a configuration (the comparison gives the trace and the loads)."""
    from loom.bench.compare import SIMULATE
    from loom.sim.measure import SimulatedMeasure

    parser = argparse.ArgumentParser(prog="loom bench compare --config NAME=simulate:")
    _setup_flags(parser)
    args, unknown = parser.parse_known_args(shlex.split(text[len(SIMULATE):]))
    if unknown:
        raise ValueError(f"{text}: {' '.join(unknown)} is not a simulated configuration's "
                         "flag (the comparison sets the trace and the loads)")
    return SimulatedMeasure(text, _setup(args), tokenizer, seed)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "simulate_command", None) == "calibrate":
        return calibrate(args)
    with _quiet_preemption_warnings():
        return simulate(args)


@contextmanager
def _quiet_preemption_warnings() -> Iterator[None]:
    """The scheduler warns on every preemption; a simulation counts them in its results."""
    log = logging.getLogger("loom.core.scheduler")
    previous = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(previous)


def _loads(flags: SimFlags, base: Load) -> list[Load]:
    if flags.overlap:
        return [replace(base, rate=math.inf, max_concurrency=c) for c in flags.overlap]
    if flags.rates:
        return [replace(base, rate=r) for r in flags.rates]
    if base.max_concurrency:
        return [base]
    raise ValueError("give --rate / --rates (open loop), --max-concurrency (closed loop) or "
                     "--overlap")


def simulate(args: argparse.Namespace) -> int:
    from loom.plan.catalogue import check_prices, parse_prices
    from loom.sim.configs import sim_configs
    from loom.sim.replay import prompt_token_ids
    from loom.sim.whatif import simulate_sweep
    from loom.workload.trace import load_trace

    flags, base = from_cli_args(SimFlags, args), from_cli_args(Load, args)
    slo, limits = from_cli_args(Report, args).slo, from_cli_args(Limits, args)
    setup = _setup(args)
    prices = parse_prices(setup.gpus.price)
    loads = _loads(flags, base)
    configs, skipped = sim_configs(setup)
    gpus = [n.lower() for n in setup.gpus.gpus] if setup.gpus.gpus else \
        [c.profile.meta.get("gpu", {}).get("key") for c in configs]
    check_prices(prices, [g for g in gpus if g])
    single = len(configs) * len(loads) == 1 and not flags.output_dir
    if not single and not flags.output_dir:
        raise ValueError("several loads or configurations: give --output-dir")
    if single and flags.output:  # fail before the work, not after it
        check_writable(flags.output, "--output")
    if flags.output_dir:
        check_folder_writable(flags.output_dir, "--output-dir")
    trace = load_trace(flags.trace)  # every field checked, naming file:line
    from loom.sim.trace_tokens import trace_tokens

    counted = trace_tokens(trace, setup.engine.model.model,
                           from_cli_args(Tokenizer, args).tokenizer)
    if counted.warning:
        print(f"warning: {counted.warning}", file=sys.stderr)
    tokenizer = None
    if any(r.prompt is not None for r in trace.requests):
        from loom.workload.tokens import load_tokenizer

        tokenizer = load_tokenizer(counted.tokenizer)
    ids = prompt_token_ids(trace, tokenizer, base.seed, max(c.model_len for c in configs))
    sweeps = [simulate_sweep(c, trace, ids, loads, slo, limits, flags.scrape_interval_s)
              for c in configs]
    runs = [r for s in sweeps for r in s.runs]
    if single and flags.output:
        save_json(runs[0].with_command(command_line()), flags.output)
    elif not single:
        _save_dir(Path(flags.output_dir), trace, sweeps, slo)
    from loom.bench.scorecard import print_scorecard

    print_scorecard(runs, slo)
    _report(runs, configs, sweeps, skipped, prices, slo)
    return 0


def _save_dir(out: Path, trace: Trace, sweeps: list[SweepResult], slo: Slo | None) -> None:
    """One sweep JSON per configuration, compare.json, scorecard.md and plots, as `loom
    bench compare` writes them."""
    from loom.bench.compare import save_compare

    entries = []
    for sweep in sweeps:
        name = sweep.config.name if sweep.config else sweep.label
        save_json(sweep.with_command(command_line()), out / f"{name}.json")
        entries.append(CompareEntry(name, f"{name}.json", sweep.flags, sweep.knee_rate, True))
    save_compare(trace, entries, sweeps, out, slo, None, command_line())
    print(f"simulated results, compare.json, scorecard.md and plots in {out}")


def _report(runs: list[RunResult], configs: list[SimConfig], sweeps: list[SweepResult],
            skipped: list[str], prices: dict[str, float], slo: Slo | None) -> None:
    from rich.console import Console

    from loom.sim.whatif import cheapest, cost_rows

    console = Console(width=200) if not Console().is_terminal else Console()
    for line in skipped:
        console.print(f"does not fit: {line}", highlight=False)
    sims = [r.simulation or {} for r in runs]
    console.print(f"simulated {sum(r.duration for r in runs):.0f} s of serving in "
                  f"{sum(s['wall_s'] for s in sims):.1f} s wall, "
                  f"{sum(s['cpu_s'] for s in sims):.1f} s CPU "
                  f"({sum(s['steps'] for s in sims)} steps)", highlight=False)
    if len(configs) > 1 or prices:
        best = cheapest(cost_rows(sweeps, configs, prices, slo))
        if not prices:
            console.print("no --price given: no cost per accepted answer", highlight=False)
        for row in best.values():
            console.print(f"[bold]cheapest{' meeting the SLO' if slo else ''} at "
                          f"{row.run.rsplit(' ', 1)[-1]}:[/bold] {row.config} "
                          f"(${row.usd_per_accepted_answer:.3g} per accepted answer at "
                          f"${row.usd_per_hour:.2f}/h)", highlight=False)
        if prices and not best:
            console.print("no priced configuration meets the SLO", highlight=False)
    from loom.cli.simulate_fit import print_band

    print_band(console, configs)
    console.print("These are simulated figures from a step-time model, not measurements: "
                  "benchmark the configuration you pick with `loom bench run` against:",
                  highlight=False)
    for config in configs:
        for name, command in config.serve_commands.items():
            if command:
                console.print(f"  {config.name} ({name}): {command}", highlight=False,
                              soft_wrap=True)


def calibrate(args: argparse.Namespace) -> int:
    from loom.config import check_device
    from loom.sim import calibrate as calibration

    flags = from_cli_args(CalibrateFlags, args)
    if flags.published:
        from loom.cli.simulate_fit import calibrate_published

        return calibrate_published(flags.calibrate_output)
    if not flags.calibrate_output:
        raise ValueError("loom simulate calibrate needs --output (or --published)")
    if flags.served:
        from loom.cli.simulate_served import calibrate_served

        return calibrate_served(flags.served, flags.calibrate_output)
    check_writable(flags.calibrate_output, "--output")  # not after minutes of measuring
    config = engine_config(args)
    check_device(config.model.device)
    logging.getLogger("loom.sim.calibrate").setLevel(logging.INFO)
    profile = calibration.calibrate(config, flags.grid, flags.repeats)
    profile.save(flags.calibrate_output)
    held, train = profile.meta["fit_error_held_out"], profile.meta["fit_error_train"]
    m = profile.step_model
    print(f"step model: {m.step_s * 1e3:.2f} ms/step + {m.seq_s * 1e6:.1f} us/seq + "
          f"{m.token_s * 1e6:.2f} us/token + {m.byte_s * 1e12:.3g} ps/KV byte + "
          f"{m.flop_s * 1e12:.3g} ps/FLOP ({1e-9 / m.flop_s if m.flop_s else 0:.1f} GFLOP/s)")
    print(f"fit error: train {train['mean_abs_pct']:.1f}% mean / {train['max_abs_pct']:.1f}% "
          f"max over {train['points']} points; held out {held['mean_abs_pct']:.1f}% mean / "
          f"{held['max_abs_pct']:.1f}% max over {held['points']} points")
    print(f"measured on {profile.meta['host']} in {profile.meta['measure_wall_s']:.0f} s; "
          f"wrote {flags.calibrate_output}")
    return 0

