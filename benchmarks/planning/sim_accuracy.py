"""How close is `loom simulate` to `loom serve`? Simulated vs measured on the same trace and
flags, on this machine, with a profile from `loom simulate calibrate`.

Runs, each measured (a real `loom serve` replayed by `loom bench`) and simulated:

* three open-loop loads: below, near and above the knee (0.5x, 1x, 1.5x). The knee is the
  highest rate within the sweep limits (p95 queue <= 2 s, errors <= 5%), found by doubling and
  bisecting on the simulator (cheap); `--rates A,B,C` gives the three loads instead;
* the middle load with a deliberately small KV cache (preemptions);
* the middle load with `--scheduler static`.

Targets (issue 14): completed req/s and output tok/s within 10%, p50/p95 TTFT and p95 E2E
within 20%, preemptions within 25%. A miss is shown, not hidden. Usage (keep it short: the
default is 60 requests per run):

    flock /tmp/loom-bench.lock python benchmarks/planning/sim_accuracy.py --out sim_accuracy.json
    python benchmarks/planning/sim_accuracy.py --profile p.json --rates 0.5,1,1.5 -n 40
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

from loom import host
from loom.cli.simulate_served import calibration_trace, serve_and_replay
from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.sim.profile import Profile
from loom.sim.result import SimConfig, simulate_run
from loom.workload.load import Load
from loom.workload.results import Limits, RunResult

# (result key, label, allowed relative error)
TARGETS = [("request_throughput", "completed req/s", 0.10),
           ("output_throughput", "output tok/s", 0.10),
           ("median_ttft_ms", "p50 TTFT", 0.20), ("p95_ttft_ms", "p95 TTFT", 0.20),
           ("p95_e2el_ms", "p95 E2E", 0.20)]
PREEMPTION_TOLERANCE = 0.25


def simulated_knee(config: SimConfig, trace: Any, ids: list[list[int]], limits: Limits) -> float:
    """Double the rate until a limit is crossed, then bisect twice (as `sweep --auto`)."""
    def crossed(rate: float) -> bool:
        return bool(limits.crossed(simulate_run(config, trace, ids, Load(rate=rate))))

    good, rate = None, 0.25
    while rate <= 64 and not crossed(rate):
        good, rate = rate, rate * 2
    if good is None:
        return rate
    bad = rate
    for _ in range(2):
        mid = math.sqrt(good * bad)
        good, bad = (good, mid) if crossed(mid) else (mid, bad)
    return good


def compare(name: str, real: RunResult, sim: RunResult,
            preemptions: bool = False) -> list[dict[str, Any]]:
    rows = []
    checks = [(k, label, tol) for k, label, tol in TARGETS]
    if preemptions:
        checks.append(("preemptions", "preemptions", PREEMPTION_TOLERANCE))
    for key, label, tol in checks:
        a, b = real.get(key), sim.get(key)
        err = None if not a or b is None else b / a - 1
        rows.append({"run": name, "metric": label, "measured": a, "simulated": b,
                     "error": err, "target": tol,
                     "ok": err is not None and abs(err) <= tol if a else a == b})
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | metric | measured | simulated | error | target | |", "|---" * 7 + "|"]
    fmt = _fmt
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error']:+.0%}"
        lines.append(f"| {r['run']} | {r['metric']} | {fmt(r['measured'])} | "
                     f"{fmt(r['simulated'])} | {err} | ±{r['target']:.0%} | "
                     f"{'ok' if r['ok'] else 'MISS'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=None, help="profile JSON (default: calibrate now)")
    parser.add_argument("--rates", default=None, help="three loads, e.g. 0.5,1,1.5 (req/s)")
    parser.add_argument("-n", "--num-requests", type=int, default=60)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--small-kv-blocks", type=int, default=160)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work-dir", default="/tmp/loom-sim-accuracy")
    parser.add_argument("--out", default=None, help="write the rows and runs as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    engine_flags = ["--max-model-len", str(args.max_model_len)]
    if args.profile:
        profile = Profile.load(args.profile)
    else:  # the same engine flags as the servers below
        from loom.sim.calibrate import calibrate

        profile = calibrate(EngineConfig.from_kwargs(max_model_len=args.max_model_len),
                            "default", 3)
        profile.save(work / "profile.json")
    trace, ids = calibration_trace(args.num_requests, args.seed)

    def config(blocks: int, scheduler: str = "continuous") -> SimConfig:
        return SimConfig("loom", profile, SchedulerConfig(scheduler=scheduler),
                         CacheConfig(num_kv_blocks=blocks), max_model_len=args.max_model_len)

    base = config(args.num_kv_blocks)
    if args.rates:
        rates = [float(x) for x in args.rates.split(",")]
        knee = rates[1]
    else:
        knee = simulated_knee(base, trace, ids, Limits())
        rates = [0.5 * knee, knee, 1.5 * knee]
    runs = [(f"@{r:.2g}/s", base, r) for r in rates]
    runs += [(f"small KV ({args.small_kv_blocks} blocks) @{knee:.2g}/s",
              config(args.small_kv_blocks), knee),
             (f"static @{knee:.2g}/s", config(args.num_kv_blocks, "static"), knee)]
    rows, results = [], []
    for i, (name, cfg, rate) in enumerate(runs):
        load = Load(rate=rate, seed=args.seed)
        real = serve_and_replay(engine_flags + cfg.flags()[2:], trace, load,
                                work / f"server-{i}.log")
        sim = simulate_run(cfg, trace, ids, load)
        rows += compare(name, real, sim, preemptions="small KV" in name)
        results.append({"name": name, "measured": real.to_json(), "simulated": sim.to_json()})
    header = (f"host: {host.describe()}; profile: {profile.source}, fit held-out error "
              f"{profile.meta.get('fit_error_held_out')}; knee {knee:.3g} req/s; "
              f"{args.num_requests} requests per run")
    print(header)
    print(markdown(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"header": header, "rows": rows, "runs": results},
                                             indent=1, default=str))


if __name__ == "__main__":
    main()
