"""`loom bench trace | run | sweep | compare | scorecard` and `loom diagnose`.

Options shared by several sub-commands live in one parent parser each, so every option is
spelled once. The options of the load (`Load`), the server under test (`Target`) and a
sweep (`Limits`, `AutoSearch`) are generated from those dataclasses, as the engine's flags
are from its config; the rest read their defaults from the dataclasses that use them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from collections.abc import Callable, Coroutine
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loom.bench.replay import Load, Target, parse_rate
from loom.bench.results import run_label
from loom.config import add_cli_args, from_cli_args

if TYPE_CHECKING:
    from loom.bench.results import Slo
    from loom.bench.sweep import Limits
    from loom.bench.trace import Trace

_MIX = "chat=0.6,long=0.15,rag=0.25"
_DEFAULT_TRACE_SIZE = 500


def _rates(text: str) -> list[float]:
    """--rates: a list of req/s, each > 0 and finite, checked before any point runs."""
    rates = [parse_rate(x.strip()) for x in text.split(",") if x.strip()]
    if not rates or any(isinstance(r, str) or math.isinf(r) for r in rates):
        raise argparse.ArgumentTypeError(f"expected req/s > 0 separated by commas, e.g. "
                                         f"0.5,1,2; got {text!r}")
    return rates


def _concurrencies(text: str) -> list[int]:
    """--overlap: a list of users, each >= 1."""
    try:
        users = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        users = []
    if not users or min(users) < 1:
        raise argparse.ArgumentTypeError(f"expected concurrencies >= 1 separated by commas, "
                                         f"e.g. 1,2,4; got {text!r}")
    return users


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a price >= 0, got {text!r}")
    return value


class _ShowDefaults(argparse.HelpFormatter):
    """Help that states each option's default: a switch's as off, 0 as 0; an option without
    one (None) says in its own help what it does when not given."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or "default" in help_text \
                or action.default == argparse.SUPPRESS or not action.option_strings:
            return help_text
        if action.default is False:
            return help_text + " (default: off)"
        return help_text + " (default: %(default)s)"


# -- shared option groups (argparse parents) -------------------------------------------------

_SEND_HELP = ("requests to send, cycling the trace if needed; default: the whole trace once "
              "(or, with --duration, as many as fit)")


def _common_parent(n_help: str = _SEND_HELP) -> argparse.ArgumentParser:
    """-n (what it counts is the command's: `n_help`), --seed, --tokenizer."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-n", "--num-requests", type=_positive_int, default=None, help=n_help)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of everything random: lengths, arrivals, synthetic prompts")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF, tokenizer.json or HF folder of the served model, to count and "
                        "synthesise prompt tokens (default: loom's bundled model)")
    return p


def _replay_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--trace", required=True, help="JSONL trace (see loom bench trace)")
    add_cli_args(p, Load, only=("burstiness", "max_concurrency", "duration_s", "burst",
                                "ramp_up"))
    add_cli_args(p, Target, only=("scrape_interval_s", "request_timeout_s", "endpoint"))
    p.add_argument("--repeats", type=int, default=1,
                   help="run each point K times; scorecard cells show medians with a "
                        "bootstrap 95%% interval, and differences inside the noise are marked")
    return p


def _reset_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--reset-prefix-cache", action="store_true",
                   help="with --repeats against a running server: POST /reset_prefix_cache "
                        "(vLLM's) before each repeat, so no repeat reuses another's cache")
    return p


def _target_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_cli_args(p, Target, only=("base_url", "model", "server_pid"))
    return p


def _slo_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--slo", default=None,
                   help="latency objective in seconds, e.g. ttft_p95=1.0,e2e_p95=10: goodput "
                        "counts requests within every limit; default: none (no goodput)")
    return p


def _report_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, parents=[_slo_parent()])
    p.add_argument("--gpu-cost-per-hour", type=_price, default=None,
                   help="price of the machine per hour: adds cost per accepted answer; "
                        "default: no cost column")
    p.add_argument("--wide", action="store_true",
                   help="print every scorecard column (default: the key ones, which fit an "
                        "80-column terminal)")
    return p


def _sweep_parent() -> argparse.ArgumentParser:
    from loom.bench.sweep import AutoSearch, Limits

    p = argparse.ArgumentParser(add_help=False)
    points = p.add_mutually_exclusive_group(required=True)
    points.add_argument("--rates", type=_rates,
                        help="offered req/s to try, e.g. 0.5,1,2,4,8 (stops after the first "
                             "beyond the limits); this, --auto or --overlap is required")
    points.add_argument("--auto", action="store_true",
                        help="find the knee: double the rate until a limit is crossed, bisect")
    points.add_argument("--overlap", type=_concurrencies,
                        help="closed loop at these concurrencies, e.g. 1,2,4,8")
    add_cli_args(p, AutoSearch)
    add_cli_args(p, Limits)
    add_cli_args(p, Load, only=("over_saturation_s",))
    return p


# -- sub-commands ----------------------------------------------------------------------------

def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register `loom bench` and its sub-commands on the top-level `loom` parser."""
    common, replay, target = _common_parent(), _replay_parent(), _target_parent()
    report, sweep, reset = _report_parent(), _sweep_parent(), _reset_parent()
    bench = sub.add_parser("bench", description="Replay realistic traffic against loom or any "
                                                "OpenAI-compatible server; sweep the offered "
                                                "load; compare configurations.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    shown = {"formatter_class": _ShowDefaults}

    generate = _common_parent(f"requests to generate (default {_DEFAULT_TRACE_SIZE}), or at "
                              "most N to import (default: all)")
    p = bench_sub.add_parser("trace", **shown, parents=[generate],
                             help="generate or import a trace")
    _trace_args(p)
    p.set_defaults(func=_trace)

    p = bench_sub.add_parser("run", **shown, parents=[target, replay, common, report, reset],
                             help="replay a trace once at one offered load",
                             description="Replay a trace once. Give --rate (open loop), "
                                         "--max-concurrency (closed loop of N users), or both "
                                         "(open loop, at most N in flight): one is required.")
    rate = next(f for f in fields(Load) if f.name == "rate")
    p.add_argument("--rate", type=parse_rate, default=argparse.SUPPRESS,
                   help=rate.metadata["help"] + " (default: inf only with --max-concurrency, "
                                                "the closed loop; one of the two is required)")
    p.add_argument("--label", default=None, help="name of the run in tables and plots; "
                                                 "default: its offered load")
    p.add_argument("--out", default=None, help="write the result JSON here; default: only "
                                               "print the scorecard")
    p.set_defaults(func=_run)

    p = bench_sub.add_parser("sweep", **shown,
                             parents=[target, replay, common, sweep, report, reset],
                             help="replay a trace at rising offered load")
    p.add_argument("--label", default=None, help="name of the configuration swept; default: "
                                                 "sweep")
    p.add_argument("--out", default=None, help="write the sweep JSON here; default: only "
                                               "print the scorecard")
    p.set_defaults(func=_sweep)

    p = bench_sub.add_parser("compare", **shown, parents=[replay, common, sweep, report],
                             help="start a server per configuration and sweep each")
    p.add_argument("--output-dir", required=True, help="where results, scorecard, plots go")
    p.add_argument("--config", action="append", default=None, metavar="NAME='FLAGS'",
                   help="a configuration (repeatable); NAME='simulate:FLAGS' runs `loom "
                        "simulate FLAGS` (e.g. --profile P.json) on the same trace and loads "
                        "instead of a server; default: continuous='' and "
                        "static='--scheduler static'")
    p.add_argument("--server-flags", default="", help="flags every configuration shares, "
                                                      "e.g. '--kv-cache-memory 1GiB'")
    p.add_argument("--server-cmd", default=None,
                   help="server command line with {port} (default: loom serve); any "
                        "OpenAI-compatible server with /health works")
    p.add_argument("--health-timeout", type=float, default=600.0,
                   help="seconds to wait for a server's /health")
    p.set_defaults(func=_compare)

    p = bench_sub.add_parser("scorecard", **shown, parents=[report],
                             help="scorecard (and plots) of result files")
    p.add_argument("results", nargs="+", help="run/sweep JSONs or compare directories")
    p.add_argument("--markdown", default=None, help="also write the scorecard as Markdown "
                                                    "to this file; default: print it only")
    p.add_argument("--plots", default=None, help="also write the plots into this directory; "
                                                 "default: no plots")
    p.set_defaults(func=_scorecard)

    p = bench_sub.add_parser("report", **shown, parents=[report],
                             help="the decision report of a compare directory",
                             description="Write DIR/report.html (one self-contained file, "
                                         "plots inline) and DIR/report.md: the decision "
                                         "checklist answered from the measured data, the "
                                         "scorecard, per-class fairness, the timelines and "
                                         "loom diagnose's findings.")
    p.add_argument("dir", help="a loom bench compare directory (or one run/sweep JSON)")
    p.add_argument("--main", default=None,
                   help="the configuration to decide on; default: the first")
    p.set_defaults(func=_report)


def add_diagnose_parser(sub: argparse._SubParsersAction) -> None:
    """Register `loom diagnose` on the top-level `loom` parser."""
    p = sub.add_parser("diagnose", parents=[_slo_parent()], formatter_class=_ShowDefaults,
                       description="Explain a disappointing loom bench result: findings, the "
                                   "numbers behind them and one setting to try; when no rule "
                                   "fires, what bounds each run.")
    p.add_argument("result", help="run or sweep JSON, or a compare directory")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=_diagnose)


def _trace_args(p: argparse.ArgumentParser) -> None:
    from loom.bench.importers import DEFAULT_RULES, FORMATS, MOONCAKE_BLOCK_SIZE
    from loom.bench.trace import ArrivalSpec, CancelSpec

    p.add_argument("-o", "--output", required=True, help="trace file to write (JSONL)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--mix", default=_MIX, help=f"class weights (default {_MIX}); "
                                                    "classes: chat, long, rag, session")
    source.add_argument("--from-sharegpt", default=None, metavar="FILE",
                        help="import ShareGPT-style conversations (JSON list or JSONL); "
                             "default: generate requests from --mix")
    source.add_argument("--from-log", default=None, metavar="FILE",
                        help="import a request log, keeping its arrival times (see --format); "
                             "default: generate requests from --mix")
    p.add_argument("--format", choices=FORMATS, default="openai",
                   help="--from-log's format: openai (JSONL of logged requests), azure (the "
                        "Azure LLM inference trace CSV), mooncake (Mooncake JSONL with hash_ids)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="--from-log: multiply the logged inter-arrival times (0.5: twice as "
                        "fast)")
    p.add_argument("--classify", default=DEFAULT_RULES,
                   help="--from-log: class rules CLASS:COND[&COND],..., first match wins; "
                        "COND compares prompt_len, output_len, prefix_len or tenant")
    p.add_argument("--hash-block-size", type=int, default=MOONCAKE_BLOCK_SIZE,
                   help="--format mooncake: tokens per hash_ids block")
    p.add_argument("--anonymize", action="store_true",
                   help="replace every text by synthetic tokens of the same lengths and prefix "
                        "sharing, and rename ids, tenants and sessions: a trace to share")
    add_cli_args(p, ArrivalSpec)
    add_cli_args(p, CancelSpec)


def _trace(args: argparse.Namespace) -> int:
    from loom.bench.results import check_writable
    from loom.bench.tokens import PromptSynth, load_tokenizer, tokenizer_path
    from loom.bench.trace import (
        ArrivalSpec,
        CancelSpec,
        generate_mix,
        import_sharegpt,
        parse_mix,
        write_trace,
    )

    arrivals, cancels = from_cli_args(ArrivalSpec, args), from_cli_args(CancelSpec, args)
    check_writable(args.output, "-o")
    path = tokenizer_path(args.tokenizer)
    synth, tokenizer_name = PromptSynth(load_tokenizer(path)), path.name
    if args.from_log:
        from loom.bench.importers import Classifier, import_log

        trace = import_log(args.from_log, args.format, synth, Classifier(args.classify),
                           args.time_scale, args.num_requests, args.seed, args.hash_block_size,
                           tokenizer_name)
    elif args.from_sharegpt:
        trace = import_sharegpt(args.from_sharegpt, args.num_requests, args.seed, synth,
                                arrivals, cancels, tokenizer_name)
    else:
        trace = generate_mix(parse_mix(args.mix), args.num_requests or _DEFAULT_TRACE_SIZE,
                             args.seed, synth, arrivals, cancels, tokenizer_name)
    if args.anonymize:
        from loom.bench.anonymize import anonymize

        trace = anonymize(trace, synth, args.seed)
    sha = write_trace(trace, args.output)
    counts: dict[str, int] = {}
    for r in trace.requests:
        counts[r.cls] = counts.get(r.cls, 0) + 1
    print(f"wrote {len(trace.requests)} requests {counts} to {args.output} (sha256 {sha})")
    return 0


def _load_trace(args: argparse.Namespace) -> Trace:
    """The trace, with prompts synthesised for records that give only prompt_len."""
    from loom.bench.trace import fill_prompts, load_trace

    trace = load_trace(args.trace)
    if any(r.prompt is None for r in trace.requests):
        from loom.bench.tokens import PromptSynth, load_tokenizer

        fill_prompts(trace, PromptSynth(load_tokenizer(args.tokenizer)), args.seed)
    return trace


def _load(args: argparse.Namespace) -> Load:
    """The load the flags give (-n and --seed included); the rest as Load has them."""
    return from_cli_args(Load, args)


def _quiet_http_log() -> None:
    """httpx logs every request at INFO: thousands of lines in a benchmark."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _slo(args: argparse.Namespace) -> Slo | None:
    from loom.bench.results import Slo

    return Slo.parse(args.slo) if args.slo else None


def _run(args: argparse.Namespace) -> int:
    _quiet_http_log()
    from loom.bench.repeats import aggregate
    from loom.bench.replay import replay
    from loom.bench.results import save_json
    from loom.bench.scorecard import print_scorecard

    load = _load(args)
    if not hasattr(args, "rate") and load.max_concurrency is None:
        raise ValueError("give --rate (open loop) or --max-concurrency (closed loop)")
    slo, trace = _checked_inputs(args)
    load.check_runnable(trace)
    target = _target(args)
    repeats = _repeated(args, target, lambda: replay(trace, load, target, slo, args.label))
    result = aggregate(repeats, slo)
    if args.out:
        save_json(result, args.out)
    print_scorecard([result], slo, args.gpu_cost_per_hour, wide=args.wide)
    return _status(repeats)


def _checked_inputs(args: argparse.Namespace) -> tuple[Slo | None, Trace]:
    """The SLO and the trace of a run or sweep, with --repeats and --out checked: all that
    can be wrong with the input is reported before the server is even asked."""
    from loom.bench.results import check_writable

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    slo = _slo(args)
    if args.out:
        check_writable(args.out, "--out")
    return slo, _load_trace(args)


def _repeated(args: argparse.Namespace, target: Target,
              measure: Callable[[], Coroutine[Any, Any, dict[str, Any]]]
              ) -> list[dict[str, Any]]:
    """--repeats results of `measure` against a running server, its prefix cache reset
    before each repeat after the first when asked."""
    from loom.bench.replay import reset_prefix_cache

    results = []
    for k in range(args.repeats):
        if k and args.reset_prefix_cache:
            reset_prefix_cache(target)
        results.append(asyncio.run(measure()))
    return results


def _target(args: argparse.Namespace) -> Target:
    """The server to test, once it is known to listen (see check_reachable)."""
    from loom.bench.replay import check_reachable

    target = from_cli_args(Target, args)
    check_reachable(target)
    return target


def _status(runs: list[dict[str, Any]]) -> int:
    """Exit status 1 when a run completed no request: a script must not read that as a
    result."""
    failed = [run for run in runs if run["completed"] == 0]
    for run in failed:
        errors = "; ".join(run.get("errors", [])[:3]) or "no errors recorded"
        print(f"loom bench: no request completed in {run_label(run)}: {errors}",
              file=sys.stderr)
    return 1 if failed else 0


def _sweep_points(args: argparse.Namespace) -> dict[str, Any]:
    from loom.bench.sweep import AutoSearch

    auto = from_cli_args(AutoSearch, args) if args.auto else None
    if args.overlap and getattr(args, "max_concurrency", None) is not None:
        raise ValueError("--overlap sets each point's concurrency; drop --max-concurrency")
    return {"rates": args.rates, "concurrencies": args.overlap, "auto": auto}


def _limits(args: argparse.Namespace) -> Limits:
    from loom.bench.sweep import Limits

    return from_cli_args(Limits, args)


def _sweep(args: argparse.Namespace) -> int:
    _quiet_http_log()
    from loom.bench.repeats import merge_sweeps
    from loom.bench.results import save_json
    from loom.bench.scorecard import print_scorecard
    from loom.bench.sweep import sweep

    load, limits, points = _load(args), _limits(args), _sweep_points(args)
    slo, trace = _checked_inputs(args)
    target = _target(args)
    result = merge_sweeps(_repeated(args, target, lambda: sweep(
        trace, load, target, limits, slo=slo, label=args.label, **points)), slo)
    if args.out:
        save_json(result, args.out)
    print_scorecard(result["runs"], slo, args.gpu_cost_per_hour, wide=args.wide)
    print(f"knee (highest offered rate within the limits): {result['knee_rate']}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    _quiet_http_log()
    from loom.bench.compare import DEFAULT_CONFIGS, compare, parse_config
    from loom.bench.scorecard import print_scorecard
    from loom.bench.server import LOOM_SERVE

    configs = [parse_config(c) for c in args.config] if args.config else DEFAULT_CONFIGS
    if len({name for name, _ in configs}) != len(configs):
        raise ValueError("configuration names must differ")
    slo, load, limits, points = _slo(args), _load(args), _limits(args), _sweep_points(args)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    out_dir = Path(args.output_dir)
    from loom.bench.results import check_folder_writable

    check_folder_writable(out_dir, "--output-dir")
    result = compare(_load_trace(args), configs, out_dir, load, limits,
                     args.server_cmd or LOOM_SERVE, args.server_flags, slo=slo,
                     gpu_cost_per_hour=args.gpu_cost_per_hour,
                     target_options={name: _target_option(args, name) for name in
                                     ("scrape_interval_s", "request_timeout_s", "endpoint")},
                     health_timeout_s=args.health_timeout, repeats=args.repeats, **points)
    print_scorecard([r for s in result["sweeps"] for r in s["runs"]], slo,
                    args.gpu_cost_per_hour, wide=args.wide,
                    groups=[(s["label"], s["runs"]) for s in result["sweeps"]])
    print(f"results, scorecard.md and plots in {out_dir}")
    return 0


def _target_option(args: argparse.Namespace, name: str) -> Any:
    """A Target option of a command that builds no Target itself (compare): the flag's value,
    else the dataclass default."""
    return getattr(args, name, next(f.default for f in fields(Target) if f.name == name))


def _scorecard(args: argparse.Namespace) -> int:
    from loom.bench.compare import write_report
    from loom.bench.results import check_folder_writable, check_writable, groups
    from loom.bench.scorecard import markdown, print_scorecard

    slo = _slo(args)
    if args.markdown:
        check_writable(args.markdown, "--markdown")
    if args.plots:
        check_folder_writable(args.plots, "--plots")
    grouped: list[tuple[str, list]] = []
    for path in args.results:
        for name, runs, _ in groups(_load_result(path)):
            if any(name == seen for seen, _ in grouped):  # same label in two files
                name = f"{name} ({Path(path).stem})"
            grouped.append((name, runs))
    runs = [run for _, runs_ in grouped for run in runs_]
    print_scorecard(runs, slo, args.gpu_cost_per_hour, wide=args.wide, groups=grouped)
    if args.markdown:
        Path(args.markdown).write_text(markdown(runs, slo, args.gpu_cost_per_hour,
                                                groups=grouped))
    if args.plots:
        sweeps = [{"label": name, "runs": runs_} for name, runs_ in grouped]
        out = Path(args.plots)
        write_report(sweeps, out, slo, args.gpu_cost_per_hour)
    return 0


def _report(args: argparse.Namespace) -> int:
    from loom.bench.report import write_decision_report

    html, md = write_decision_report(Path(args.dir), _slo(args), args.gpu_cost_per_hour,
                                     args.main)
    print(f"wrote {html} and {md}")
    return 0


def _load_result(path: str) -> dict[str, Any]:
    """A result file, or an error that says what the file is instead (a trace, say)."""
    from loom.bench.results import load_result

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


def _diagnose(args: argparse.Namespace) -> int:
    from rich.console import Console

    from loom.bench.diagnose import diagnose, what_bounds

    result = _load_result(args.result)
    findings = diagnose(result, _slo(args))
    if args.json:  # what bounds each run is part of the answer, findings or not
        print(json.dumps({"findings": [asdict(f) for f in findings],
                          "what_bounds": what_bounds(result)}, indent=1))
        return 0
    console = Console()
    for f in findings:
        console.print(f"[bold]{f.title}[/bold] ({f.run})\n  {f.message}\n"
                      f"  [bold]Try:[/bold] {f.setting}\n", highlight=False)
    if not findings:
        console.print("No rule fired: no sign of a scheduling, admission, memory or "
                      "client-side constraint in these figures. What bounds each run:\n",
                      highlight=False)
        for line in what_bounds(result):
            console.print(f"  {line}", highlight=False)
    return 0
