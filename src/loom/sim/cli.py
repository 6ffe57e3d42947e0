"""`loom simulate` (the real scheduler on a virtual clock) and `loom simulate calibrate`.

Only argparse and the flag helpers are imported at module level; the work is imported inside
the command, so `loom --help` stays fast. Only `calibrate` loads torch and the model.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loom.config import EngineConfig
from loom.plan.cli import add_model_args, csv_ints, model_help


def _rates(text: str) -> list[float | str]:
    """'0.5,1,inf,trace' -> rates; 'trace' replays the trace's own arrival_s."""
    out: list[float | str] = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            out.append(x if x == "trace" else math.inf if x == "inf" else float(x))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{x!r} is not a rate: give requests per second, inf or trace") from None
    return out


def _routers(text: str) -> list[str]:
    from loom.cluster.routing import ROUTERS

    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in ROUTERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown router {', '.join(unknown) or text!r}; "
                                         f"choose from {', '.join(ROUTERS)}")
    return names


USAGE = """%(prog)s (--profile PROFILE | --gpus GPUS --model MODEL) --trace TRACE
                     (--rate RATE | --max-concurrency N | --overlap LIST) [options]
       %(prog)s calibrate --output PROFILE [options]"""


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from loom.bench.cli import _common_parent, _slo_parent

    p = sub.add_parser(
        "simulate", parents=[_common_parent(), _slo_parent()], usage=USAGE,
        help="replay a trace on loom's scheduler with modelled step times",
        description="Drive loom's real scheduler and KV cache with a step-time profile on a "
                    "virtual clock; writes loom bench's result JSON marked simulated. Profiles "
                    "come from `loom simulate calibrate` (this machine) or from the GPU "
                    "catalogue (--gpus, roofline).")
    p.add_argument("--profile", default=None,
                   help="step profile JSON (loom simulate calibrate); none = a "
                        "roofline profile per --gpus")
    p.add_argument("--trace", default=None,
                   help="JSONL trace (see loom bench trace); required (no default)")
    p.add_argument("--rate", type=_rates, default=None, dest="rates",
                   help="offered req/s ('inf': all at once, 'trace': arrival_s as "
                        "recorded); a list runs a sweep; give it, --max-concurrency or "
                        "--overlap (no default)")
    p.add_argument("--rates", type=_rates, default=None, dest="rates",
                   help="same as --rate with a list, e.g. 0.5,1,2,4 (no default)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most; alone: closed loop of N users; "
                        "default: no cap")
    p.add_argument("--overlap", type=csv_ints, default=None,
                   help="closed loop at these concurrencies, e.g. 1,2,4,8; default: none")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier "
                        "(default: %(default)s)")
    p.add_argument("--duration", type=float, default=None,
                   help="simulated seconds to keep sending (cycling the trace); default: "
                        "send the trace (or -n requests) once")
    p.add_argument("--scrape-interval", type=float, default=1.0,
                   help="simulated seconds between timeline samples (default: %(default)s)")
    p.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="server admission limit: 503 when this many wait (as loom serve); "
                        "none = no limit")
    p.add_argument("--queue-timeout", type=float, default=None,
                   help="server: 503 for a request not scheduled within this many seconds; "
                        "none = wait")
    p.add_argument("--max-p95-queue", type=float, default=2.0,
                   help="sweep limit: p95 queue time in seconds (for the knee; default: "
                        "%(default)s)")
    p.add_argument("--max-error-rate", type=float, default=0.05,
                   help="sweep limit: failed/sent (default: %(default)s)")
    p.add_argument("--replicas", type=csv_ints, default=[1],
                   help="fleet: engines behind a router, as loom serve --data-parallel-size "
                        "runs them; a list (e.g. 10,100) simulates each size (default: 1)")
    p.add_argument("--router", type=_routers, default=["prefix"],
                   help="fleet routing policy: prefix, pow2 or round-robin; a list simulates "
                        "each (default: prefix)")
    p.add_argument("--label", default=None,
                   help="name of the configuration; default: the profile's file name")
    p.add_argument("--output", default=None,
                   help="result JSON (one profile, one load); default: none written")
    p.add_argument("--output-dir", default=None,
                   help="several loads or configurations: sweep JSONs, compare.json, "
                        "scorecard.md and plots, as loom bench compare writes them; required "
                        "then (no default)")
    add_model_args(p, "what-if: simulate each of these GPUs (roofline profiles from the "
                      "catalogue, KV capacity from loom plan) with --model; none = "
                      "--profile")
    EngineConfig.add_cli_args(p)
    _option(p, "--model").help = model_help("the bundled model; with --profile: the model "
                                            "it was calibrated on")
    _option(p, "--seed").help += " (default: %(default)s)"
    p.set_defaults(func=run_simulate)

    subs = p.add_subparsers(dest="simulate_command", metavar="calibrate",
                            title="sub-command (optional)")
    cal = subs.add_parser("calibrate", help="measure loom's engine here and fit a step profile",
                          description="Time loom's engine offline on this machine over a grid "
                                      "of prefill tokens x decode sequences x context, fit the "
                                      "roofline-shaped step model and report its held-out "
                                      "error.")
    cal.add_argument("--output", required=True, dest="calibrate_output", metavar="PROFILE",
                     help="profile JSON to write")
    cal.add_argument("--grid", choices=["quick", "default"], default="default",
                     help="quick: a smoke run in seconds; default: a few minutes on 2 cores "
                          "(default: %(default)s)")
    cal.add_argument("--repeats", type=int, default=3,
                     help="timed steps per grid point (default: %(default)s)")
    EngineConfig.add_cli_args(cal)


def run_simulate(args: argparse.Namespace) -> int:
    if getattr(args, "simulate_command", None) == "calibrate":
        from loom.sim.calibrate import run_calibrate

        return run_calibrate(args)
    with _quiet_preemption_warnings():
        return _simulate(args)


@contextmanager
def _quiet_preemption_warnings() -> Iterator[None]:
    """The scheduler warns on every preemption; a simulation counts them in its results. The
    level is put back after, since `loom bench compare` runs simulations in its own process."""
    log = logging.getLogger("loom.core.scheduler")
    previous = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(previous)


def _simulate(args: argparse.Namespace) -> int:
    from loom.bench.results import Slo, check_folder_writable, check_writable, save_json
    from loom.bench.scorecard import print_scorecard
    from loom.bench.sweep import Limits
    from loom.plan.catalogue import check_prices, parse_prices
    from loom.sim.whatif import sweep_config

    if not args.trace:
        raise ValueError("loom simulate needs --trace (or the calibrate sub-command)")
    _check_flags(args)
    prices = parse_prices(args.price)
    points = _points(args)
    configs, skipped = _configs(args)
    gpus = [n.lower() for n in args.gpus] if args.gpus else \
        [c.profile.meta.get("gpu", {}).get("key") for c in configs]
    check_prices(prices, [g for g in gpus if g])
    single = len(configs) * len(points) == 1 and not args.output_dir
    if not single and not args.output_dir:
        raise ValueError("several loads or configurations: give --output-dir")
    if single and args.output:  # fail before the work, not after it
        check_writable(args.output, "--output")
    if args.output_dir:
        check_folder_writable(args.output_dir, "--output-dir")
    trace, token_ids = _trace(args, max(c.model_len for c in configs))
    slo = Slo.parse(args.slo) if args.slo else None
    limits = Limits(args.max_p95_queue, args.max_error_rate)
    base = _base_load(args)
    sweeps = [sweep_config(c, trace, token_ids, base, points, limits, slo, args.scrape_interval)
              for c in configs]
    runs = [r for s in sweeps for r in s["runs"]]
    if single and args.output:
        save_json(runs[0], args.output)
    elif not single:
        _save_dir(args, trace, configs, sweeps, slo)
    print_scorecard(runs, slo)
    _report(runs, configs, sweeps, skipped, prices, slo)
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """The load and sweep flags' ranges, before any work: out of range, a run sends no
    request (or fails them all) and would still exit 0."""
    at_least_one = {"--max-concurrency": [args.max_concurrency],  # -n: by its parser
                    "--overlap": args.overlap or [], "--replicas": args.replicas}
    positive = {"--duration": args.duration, "--burstiness": args.burstiness,
                "--scrape-interval": args.scrape_interval, "--max-p95-queue": args.max_p95_queue}
    for flag, values in at_least_one.items():
        bad = [v for v in values if v is not None and v < 1]
        if bad:
            raise ValueError(f"{flag} must be >= 1, got {bad[0]}")
    for flag, value in positive.items():
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value:g}")
    if not 0 <= args.max_error_rate <= 1:
        raise ValueError(f"--max-error-rate must be in [0, 1], got {args.max_error_rate:g}")
    bad_rates = [r for r in args.rates or [] if r != "trace" and not r > 0]
    if bad_rates:
        raise ValueError(f"--rate must be > 0 (or inf, or trace), got {bad_rates[0]:g}")


def _points(args: argparse.Namespace) -> list[Any]:
    from loom.sim.whatif import Point

    if args.overlap:
        return [Point(math.inf, c) for c in args.overlap]
    if args.rates:
        return [Point(r) for r in args.rates]
    if args.max_concurrency:
        return [Point(math.inf, args.max_concurrency)]
    raise ValueError("give --rate / --rates (open loop), --max-concurrency (closed loop) or "
                     "--overlap")


def _base_load(args: argparse.Namespace) -> Any:
    from loom.bench.replay import Load

    return Load(rate=math.inf, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                duration_s=args.duration, num_requests=args.num_requests, seed=args.seed)


def _trace(args: argparse.Namespace, max_model_len: int) -> tuple[Any, list[list[int]]]:
    """The trace, checked before anything runs, and its prompts' token ids: text is
    tokenized with --tokenizer, as the server the trace stands for would count it."""
    from loom.bench.trace import load_trace
    from loom.sim.replay import prompt_token_ids

    trace = load_trace(args.trace)  # every field checked, naming file:line
    tokenizer = None
    if any(r.prompt is not None for r in trace.requests):
        from loom.bench.tokens import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    return trace, prompt_token_ids(trace, tokenizer, args.seed, max_model_len)


def _configs(args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """The simulated servers: one per --profile, or one per (GPU, TP) that fits."""
    from loom.plan.catalogue import PlanError
    from loom.sim.profile import Profile, roofline_profile
    from loom.sim.replay import ServerLimits
    from loom.sim.result import SimConfig

    engine = EngineConfig.from_cli_args(args)
    _refuse_unmodelled(engine)
    limits = ServerLimits(args.max_num_queued_reqs, args.queue_timeout)
    common = {"scheduler": engine.scheduler, "cache": engine.cache, "limits": limits,
              "max_model_len": engine.model.max_model_len}
    if args.profile:
        if args.gpus:
            raise ValueError("give --profile or --gpus, not both")
        config = SimConfig(args.label or Path(args.profile).stem, Profile.load(args.profile),
                           **common)
        flags = config.profile.engine_flags()
        if engine.model.model:  # the model asked for here, over the one calibrated
            flags = [*_without(flags, "--model"), "--model", engine.model.model]
        config.serve_commands["loom"] = " ".join(["loom", "serve", *flags, *config.flags()])
        return _fleets([config], args.replicas, args.router), []
    if not args.gpus:
        raise ValueError("give --profile PROFILE.json (loom simulate calibrate) or --gpus "
                         "with --model (roofline)")
    from loom.plan.cli import resolve_gpu_args, settings_from_args
    from loom.plan.models import resolve_model
    from loom.plan.planner import capacity, flags

    model = resolve_model(engine.model.model)
    vars(args).update(block_size=engine.cache.block_size,
                      max_model_len=engine.model.max_model_len,
                      max_num_batched_tokens=engine.scheduler.max_num_batched_tokens,
                      max_num_seqs=engine.scheduler.max_num_seqs)
    settings = settings_from_args(args, model, [1])
    common["max_model_len"] = settings.max_model_len
    configs, skipped = [], []
    for gpu in resolve_gpu_args(args):
        for tp in settings.tensor_parallel_sizes:
            try:
                profile = roofline_profile(model, gpu, tp, settings)
            except PlanError as e:
                skipped.append(f"{gpu.key} x{tp}: {e}")
                continue
            serve = flags(capacity(model, gpu, tp, settings), model, settings)
            loom = serve["loom_serve"]
            if loom and serve["download"]:  # loom reads from disk; vllm fetches the name
                loom = f"{serve['download']} && {loom}"
            configs.append(SimConfig(f"{gpu.key}-tp{tp}", profile, **common,
                                     serve_commands={"loom": loom,
                                                     "vllm": serve["vllm_serve"]}))
    if not configs:
        raise ValueError("no configuration fits: " + "; ".join(skipped))
    return _fleets(configs, args.replicas, args.router), skipped


def _without(flags: list[str], name: str) -> list[str]:
    """`flags` (name, value pairs) without `name` and its value."""
    pairs = list(zip(flags[::2], flags[1::2]))
    return [x for pair in pairs if pair[0] != name for x in pair]


def _refuse_unmodelled(engine: EngineConfig) -> None:
    """Engine flags the step model cannot represent are refused, not ignored: the results
    would be labelled with a configuration that was never simulated."""
    if engine.scheduler.async_scheduling:
        raise ValueError("loom simulate does not model --async-scheduling (its steps run "
                         "back to back); drop the flag")
    if engine.scheduler.speculative_config is not None:
        raise ValueError("loom simulate does not model --speculative-config (draft tokens "
                         "and their acceptance need the model); drop the flag")


def _fleets(configs: list[Any], replicas: list[int], routers: list[str]) -> list[Any]:
    """Each configuration as a fleet of every size asked for, behind every router asked for
    (one engine needs no router)."""
    import dataclasses

    out = []  # SimConfig refuses a fleet of fewer than one replica
    for config in configs:
        for n in replicas:
            for router in routers if n > 1 else routers[:1]:
                name = config.name if n == 1 else f"{config.name}-x{n}-{router}"
                out.append(dataclasses.replace(
                    config, name=name, replicas=n, router=router,
                    serve_commands=_fleet_commands(config.serve_commands, n, router)))
    return out


def _fleet_commands(commands: dict[str, str | None], replicas: int,
                    router: str) -> dict[str, str | None]:
    """The serve commands of one replica, run as a fleet."""
    if replicas == 1:
        return dict(commands)
    out: dict[str, str | None] = {}
    for name, command in commands.items():
        if command and name == "loom":
            out[name] = f"{command} --data-parallel-size {replicas} --router {router}"
        elif command:
            out[name] = f"{command} --data-parallel-size {replicas}"
    return out


def _save_dir(args: argparse.Namespace, trace: Any, configs: list[Any],
              sweeps: list[dict[str, Any]], slo: Any) -> None:
    from loom.bench.compare import save_compare
    from loom.bench.results import save_json

    out = Path(args.output_dir)
    entries = []
    for config, sweep in zip(configs, sweeps):
        save_json(sweep, out / f"{config.name}.json")
        entries.append({"name": config.name, "flags": sweep["config"]["flags"],
                        "file": f"{config.name}.json", "knee_rate": sweep["knee_rate"],
                        "simulated": True})
    save_compare(trace, entries, sweeps, out, slo, None)
    print(f"simulated results, compare.json, scorecard.md and plots in {out}")


def _report(runs: list[dict[str, Any]], configs: list[Any], sweeps: list[dict[str, Any]],
            skipped: list[str], prices: dict[str, float], slo: Any) -> None:
    from rich.console import Console

    from loom.sim.whatif import cheapest, cost_rows

    console = Console(width=200) if not Console().is_terminal else Console()
    for line in skipped:
        console.print(f"does not fit: {line}", highlight=False)
    sims = [r["simulation"] for r in runs]
    console.print(f"simulated {sum(r['duration'] for r in runs):.0f} s of serving in "
                  f"{sum(s['wall_s'] for s in sims):.1f} s wall, "
                  f"{sum(s['cpu_s'] for s in sims):.1f} s CPU "
                  f"({sum(s['steps'] for s in sims)} steps)", highlight=False)
    if len(configs) > 1 or prices:
        rows = cost_rows(sweeps, configs, prices, slo)
        best = cheapest(rows)
        if not prices:
            console.print("no --price given: no cost per accepted answer", highlight=False)
        for row in best.values():
            console.print(f"[bold]cheapest{' meeting the SLO' if slo else ''} at "
                          f"{row['run'].rsplit(' ', 1)[-1]}:[/bold] {row['config']} "
                          f"(${row['usd_per_accepted_answer']:.3g} per accepted answer at "
                          f"${row['usd_per_hour']:.2f}/h)", highlight=False)
        if prices and not best:
            console.print("no priced configuration meets the SLO", highlight=False)
    console.print("These are simulated figures from a step-time model, not measurements: "
                  "benchmark the configuration you pick with `loom bench run` against:",
                  highlight=False)
    for config in configs:
        for name, command in config.serve_commands.items():
            if command:
                console.print(f"  {config.name} ({name}): {command}", highlight=False,
                              soft_wrap=True)
