"""Does the served calibration close the gap? On a trace neither profile saw, 16 concurrent
users at a low load and at the knee: `loom serve` measured (replayed by `loom bench`) against
the simulation on the offline profile and on the served one (`loom simulate calibrate
--served`). Targets (issue 53, item 8): output tok/s within 10%, median TTFT within 20%.

    flock -x /tmp/loom-bench.lock python benchmarks/planning/served_check.py \
        --offline offline.json --served served.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.planning.sim_accuracy import simulated_knee  # noqa: E402
from loom import host  # noqa: E402
from loom.cli.simulate_served import calibration_trace, serve_and_replay
from loom.sim.profile import Profile
from loom.sim.result import simulate_run
from loom.sim.served import sim_config
from loom.workload.load import Load
from loom.workload.results import Limits

USERS = 16
CHECKS = (("output_throughput", "output tok/s", 0.10), ("median_ttft_ms", "p50 TTFT", 0.20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--offline", required=True)
    ap.add_argument("--served", required=True)
    ap.add_argument("-n", "--num-requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=11, help="not the calibration trace's seed")
    ap.add_argument("--work-dir", default="/tmp/loom-served-check")
    args = ap.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    offline, served = Profile.load(args.offline), Profile.load(args.served)
    trace, ids = calibration_trace(args.num_requests, args.seed)
    configs = {name: sim_config(p, p.max_model_len) for name, p in
               (("offline", offline), ("served", served))}
    knee = simulated_knee(configs["served"], trace, ids, Limits())
    print(f"host: {host.describe()}; {args.num_requests} requests (seed {args.seed}), "
          f"{USERS} users at most; knee (simulated, served profile) {knee:.3g} req/s")
    print("| load | metric | measured | offline sim (error) | served sim (error) | target |")
    print("|---|---|--:|--:|--:|--:|")
    for label, rate in (("low", 0.25 * knee), ("knee", knee)):
        load = Load(rate=rate, max_concurrency=USERS, seed=args.seed)
        real = serve_and_replay(configs["served"].flags(), trace, load,
                                work / f"server-{label}.log")
        sims = {k: simulate_run(c, trace, ids, load) for k, c in configs.items()}
        for key, name, tol in CHECKS:
            a = real.get(key)
            cells = [f"{s.get(key):.3g} ({s.get(key) / a - 1:+.0%})" for s in sims.values()]
            print(f"| {label} @{rate:.2g}/s | {name} | {a:.3g} | {' | '.join(cells)} | "
                  f"±{tol:.0%} |", flush=True)


if __name__ == "__main__":
    main()
