"""`loom bench trace | run | sweep | compare | scorecard | report`.

Every option is a dataclass field, spelled once: the load (`Load`), the server under test
(`Target`), a sweep's limits and knee search (`Limits`, `AutoSearch`) are the libraries'
own; the rest (inputs, outputs, the report's options) are this module's, shared by the
sub-commands that take them. Everything that can be wrong with the input is reported
before a server is asked anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.bench.replay import Target
from loom.bench.sweep import AutoSearch
from loom.cli.dataclass_flags import from_cli_args
from loom.cli.flags import (
    Report,
    Tokenizer,
    add_command,
    check_folder_writable,
    check_writable,
    command_line,
    opt,
    overlap,
    required,
)
from loom.cli.flags import rates as rate_list
from loom.cli.main import help_of
from loom.config import require_at_least
from loom.workload.load import Load
from loom.workload.results import Limits, Result, RunResult, load_result, run_label, save_json
from loom.workload.slo import Slo
from loom.workload.sweeps import SweepSpec
from loom.workload.trace import Trace

SHORT = {"num_requests": "-n"}
LOAD = ("burstiness", "max_concurrency", "duration_s", "burst", "ramp_up", "num_requests",
        "seed")
TARGET = ("scrape_interval_s", "request_timeout_s", "endpoint")


@dataclass(frozen=True)
class Replay:
    """The trace replayed, and how often."""

    CLI_GROUP = "Replay"

    trace: str = required("JSONL trace (see loom bench trace)")
    repeats: int = opt(1,
        "run each point K times; scorecard cells show medians with a bootstrap 95%% "
        "interval, and differences inside the noise are marked")
    reset_prefix_cache: bool = opt(False,
        "with --repeats against a running server: POST /reset_prefix_cache (vLLM's) before "
        "each repeat, so no repeat reuses another's cache")
    label: str | None = opt(None,
        "name of the run (a sweep: of the configuration swept) in tables and plots; "
        "default: its offered load (a sweep: sweep)")
    out: str | None = opt(None,
        "write the result (run or sweep) JSON here; default: only print the scorecard")

    def __post_init__(self) -> None:
        require_at_least(1, {"--repeats": self.repeats})


@dataclass(frozen=True)
class Points:
    """A sweep's points: one of the three is required."""

    CLI_GROUP = "Sweep points"

    rates: tuple[float, ...] | None = opt(None,
        "offered req/s to try, e.g. 0.5,1,2,4,8 (stops after the first beyond the limits); "
        "default: none (this, --auto or --overlap is required)", parse=rate_list)
    auto: bool = opt(False, "find the knee: double the rate until a limit is crossed, bisect")
    overlap: tuple[int, ...] | None = overlap()


@dataclass(frozen=True)
class Compare:
    CLI_GROUP = "Comparison"

    output_dir: str = required("where results, scorecard, plots go")
    config: list[str] = opt(list,
        "a configuration NAME='FLAGS' (repeatable); NAME='simulate:FLAGS' runs `loom "
        "simulate FLAGS` (e.g. --profile P.json) on the same trace and loads instead of a "
        "server; default: continuous='' and static='--scheduler static'")
    server_flags: str = opt("", "flags every configuration shares, e.g. '--kv-cache-memory 1GiB'")
    server_cmd: str | None = opt(None,
        "server command line with {port} (default: loom serve); any OpenAI-compatible "
        "server with /health works")
    health_timeout: float = opt(600.0, "seconds to wait for a server's /health")


@dataclass(frozen=True)
class Files:
    """What scorecard and report read and write."""

    CLI_GROUP = "Files"

    results: list[str] = opt(list, "run/sweep JSONs or compare directories", positional=True)
    dir: str = opt("", "a loom bench compare directory (or one run/sweep JSON)", positional=True)
    markdown: str | None = opt(None,
        "also write the scorecard as Markdown to this file; default: print it only")
    plots: str | None = opt(None, "also write the plots into this directory; default: no plots")
    main: str | None = opt(None, "the configuration to decide on; default: the first")


SWEEP = (Points, AutoSearch, Limits, (Load, (*LOAD, "over_saturation_s")))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `loom bench` and its sub-commands on the top-level `loom` parser."""
    from loom.cli import bench_trace

    bench = sub.add_parser("bench", help=help_of("bench"),
                           description="Replay realistic traffic against loom or any "
                                       "OpenAI-compatible server; sweep the offered load; "
                                       "compare configurations.")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    bench_trace.add_parser(commands)

    online = (Target, ("base_url", "model", "server_pid", *TARGET))
    add_command(commands, "run", run, online, Replay, Tokenizer, (Load, ("rate", *LOAD)), Report,
                short=SHORT, help="replay a trace once at one offered load",
                description="Replay a trace once. Give --rate (open loop), --max-concurrency "
                            "(closed loop of N users), or both (open loop, at most N in "
                            "flight): one is required.")
    add_command(commands, "sweep", sweep, online, Replay, Tokenizer, *SWEEP, Report,
                short=SHORT,
                help="replay a trace at rising offered load")
    add_command(commands, "compare", compare, Compare, (Replay, ("trace", "repeats")),
                Tokenizer,
                (Target, TARGET), *SWEEP, Report, short=SHORT,
                help="start a server per configuration and sweep each")
    add_command(commands, "scorecard", scorecard, (Files, ("results", "markdown", "plots")),
                Report, help="scorecard (and plots) of result files")
    add_command(commands, "report", report, (Files, ("dir", "main")), Report,
                help="the decision report of a compare directory",
                description="Write DIR/report.html (one self-contained file, plots inline) "
                            "and DIR/report.md: the decision checklist answered from the "
                            "measured data, the scorecard, per-class fairness, the timelines "
                            "and loom diagnose's findings.")


# -- reading the flags -----------------------------------------------------------------------

def _replay_inputs(args: argparse.Namespace) -> tuple[Replay, Report, Trace]:
    """The replay's flags, the report's and the trace, with --out checked: all that can be
    wrong with the input is reported before the server is even asked."""
    replay, shown = from_cli_args(Replay, args), from_cli_args(Report, args)
    if replay.out:
        check_writable(replay.out, "--out")
    tokenizer = from_cli_args(Tokenizer, args).tokenizer
    return replay, shown, load_trace(replay.trace, tokenizer, from_cli_args(Load, args))


def load_trace(path: str, tokenizer: str | None, load: Load) -> Trace:
    """The trace, with prompts synthesised for records that give only prompt_len."""
    from loom.workload.trace import fill_prompts
    from loom.workload.trace import load_trace as read

    trace = read(path)
    if any(r.prompt is None for r in trace.requests):
        from loom.workload.tokens import PromptSynth, load_tokenizer

        fill_prompts(trace, PromptSynth(load_tokenizer(tokenizer)), load.seed)
    return trace


def _spec(args: argparse.Namespace, slo: Slo | None) -> SweepSpec:
    points, load = from_cli_args(Points, args), from_cli_args(Load, args)
    if points.overlap and load.max_concurrency is not None:
        raise ValueError("--overlap sets each point's concurrency; drop --max-concurrency")
    return SweepSpec(load, from_cli_args(Limits, args), points.rates, points.overlap,
                     from_cli_args(AutoSearch, args) if points.auto else None, slo)


def _quiet_http_log() -> None:
    """httpx logs every request at INFO: thousands of lines in a benchmark."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _target(args: argparse.Namespace) -> Target:
    """The server to test, once it is known to listen (see check_reachable)."""
    from loom.bench.replay import check_reachable

    target = from_cli_args(Target, args)
    check_reachable(target)
    return target


def _repeated(replay: Replay, target: Target,
              measure: Callable[[], Coroutine[Any, Any, Any]]) -> list[Any]:
    """--repeats results of `measure` against a running server, its prefix cache reset
    before each repeat after the first when asked."""
    from loom.bench.replay import reset_prefix_cache

    results = []
    for k in range(replay.repeats):
        if k and replay.reset_prefix_cache:
            reset_prefix_cache(target)
        results.append(asyncio.run(measure()))
    return results


# -- the commands ----------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    _quiet_http_log()
    from loom.bench.repeats import aggregate
    from loom.bench.replay import replay as replay_trace
    from loom.bench.scorecard import print_scorecard

    load = from_cli_args(Load, args)
    if "rate" not in vars(args) and load.max_concurrency is None:
        raise ValueError("give --rate (open loop) or --max-concurrency (closed loop)")
    replay, shown, trace = _replay_inputs(args)
    load.check_runnable(trace)
    target = _target(args)
    repeats = _repeated(replay, target, lambda: replay_trace(trace, load, target, shown.slo,
                                                              replay.label))
    result = aggregate(repeats, shown.slo)
    if replay.out:
        save_json(result.with_command(command_line()), replay.out)
    print_scorecard([result], shown.slo, shown.gpu_cost_per_hour, wide=shown.wide)
    return _status(repeats)


def _status(runs: list[RunResult]) -> int:
    """Exit status 1 when a run completed no request: a script must not read that as a
    result."""
    failed = [run for run in runs if run.figures.completed == 0]
    for run in failed:
        errors = "; ".join(run.errors[:3]) or "no errors recorded"
        print(f"loom bench: no request completed in {run_label(run)}: {errors}",
              file=sys.stderr)
    return 1 if failed else 0


def sweep(args: argparse.Namespace) -> int:
    _quiet_http_log()
    from loom.bench.repeats import merge_sweeps
    from loom.bench.scorecard import print_scorecard
    from loom.bench.sweep import sweep as sweep_trace

    replay, shown, trace = _replay_inputs(args)
    spec = _spec(args, shown.slo)
    target = _target(args)
    result = merge_sweeps(_repeated(replay, target, lambda: sweep_trace(
        trace, spec.load, target, spec.limits, spec.rates, spec.concurrencies, spec.auto,
        spec.slo, replay.label)), spec.slo)
    if replay.out:
        save_json(result.with_command(command_line()), replay.out)
    print_scorecard(result.runs, spec.slo, shown.gpu_cost_per_hour, wide=shown.wide)
    print(f"knee (highest offered rate within the limits): {result.knee_rate}")
    return 0


def compare(args: argparse.Namespace) -> int:
    _quiet_http_log()
    from loom.bench.compare import DEFAULT_CONFIGS, SIMULATE, ServerMeasure, parse_config
    from loom.bench.compare import compare as compare_configs
    from loom.bench.scorecard import print_scorecard
    from loom.bench.server import LOOM_SERVE

    flags, shown = from_cli_args(Compare, args), from_cli_args(Report, args)
    replay, tokenizer = from_cli_args(Replay, args), from_cli_args(Tokenizer, args).tokenizer
    spec = _spec(args, shown.slo)
    out_dir = Path(flags.output_dir)
    check_folder_writable(out_dir, "--output-dir")
    target = {name: getattr(args, name) for name in TARGET if name in vars(args)}
    configs = []
    for name, text in [parse_config(c) for c in flags.config] or DEFAULT_CONFIGS:
        if text.startswith(SIMULATE):
            from loom.cli.simulate import measure

            configs.append((name, measure(text, tokenizer, spec.load.seed)))
        else:
            configs.append((name, ServerMeasure(flags.server_cmd or LOOM_SERVE,
                                                f"{flags.server_flags} {text}".strip(),
                                                target, flags.health_timeout)))
    trace = load_trace(replay.trace, tokenizer, spec.load)
    result = compare_configs(trace, configs, spec, out_dir, replay.repeats,
                             shown.gpu_cost_per_hour, command_line())
    print_scorecard([r for s in result.sweeps for r in s.runs], spec.slo,
                    shown.gpu_cost_per_hour, wide=shown.wide,
                    groups=[(s.label, s.runs) for s in result.sweeps])
    print(f"results, scorecard.md and plots in {out_dir}")
    return 0


def scorecard(args: argparse.Namespace) -> int:
    from loom.bench.compare import write_report
    from loom.bench.scorecard import markdown, print_scorecard
    from loom.workload.results import SweepResult, groups

    files, shown = from_cli_args(Files, args), from_cli_args(Report, args)
    if files.markdown:
        check_writable(files.markdown, "--markdown")
    if files.plots:
        check_folder_writable(files.plots, "--plots")
    grouped: list[tuple[str, list[RunResult]]] = []
    for path in files.results:
        for name, runs, _ in groups(read_result(path)):
            if any(name == seen for seen, _ in grouped):  # same label in two files
                name = f"{name} ({Path(path).stem})"
            grouped.append((name, runs))
    runs = [run for _, runs_ in grouped for run in runs_]
    print_scorecard(runs, shown.slo, shown.gpu_cost_per_hour, wide=shown.wide, groups=grouped)
    if files.markdown:
        Path(files.markdown).write_text(markdown(runs, shown.slo, shown.gpu_cost_per_hour,
                                                 groups=grouped))
    if files.plots:
        write_report([SweepResult(name, runs_) for name, runs_ in grouped], Path(files.plots),
                     shown.slo, shown.gpu_cost_per_hour)
    return 0


def report(args: argparse.Namespace) -> int:
    from loom.bench.report import write_decision_report

    files, shown = from_cli_args(Files, args), from_cli_args(Report, args)
    html, md = write_decision_report(Path(files.dir), shown.slo, shown.gpu_cost_per_hour,
                                     files.main)
    print(f"wrote {html} and {md}")
    return 0


def read_result(path: str) -> Result:
    """A result file, or an error that says what the file is instead (a trace, say)."""
    try:
        return load_result(path)
    except json.JSONDecodeError as e:
        if _is_trace(Path(path)):
            raise ValueError(f"{path} is a trace (JSONL), not a bench result: replay it with "
                             f"`loom bench run --trace {path} ... --out run.json` and pass "
                             "run.json") from None
        raise ValueError(f"{path} is not a loom bench result (JSON): {e}") from None


def _is_trace(path: Path) -> bool:
    """Does the file start like a trace: a JSON object per line, a header or a request?"""
    try:
        with path.open() as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and bool({"header", "prompt", "prompt_len"} & set(first))

