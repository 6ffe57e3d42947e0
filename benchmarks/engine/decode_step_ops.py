"""Decode-step time and torch ops per step, for one or more source trees side by side.

    python benchmarks/engine/decode_step_ops.py --batches 1 32 --trees . ../base --rounds 3

Each (round, batch, tree) runs in its own process with that tree's sources (PYTHONPATH), the
trees taking turns (harness.round_order) so that the machine's load falls on all of them
alike. A child builds this checkout's `step_profile.busy_engine` on its tree's loom with B
requests decoding, times `engine.step()` (median and 10th percentile) and counts the torch ops
of a few steps under the profiler. `--table` prints the profiler's table (self CPU time) of
the first tree's children instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# the checkout, for benchmarks.*: the children time this checkout's busy engine on their
# tree's loom (PYTHONPATH)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def child(batch: int, steps: int, table: bool) -> None:
    import torch

    from benchmarks.engine.step_profile import busy_engine

    engine = busy_engine("auto", batch, 0)
    for _ in range(20):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    profiled = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(profiled):
            engine.step()
    events = prof.key_averages()
    if table:
        print(events.table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr)
    times.sort()
    print(json.dumps({"median_ms": statistics.median(times) * 1e3,
                      "p10_ms": times[len(times) // 10] * 1e3,
                      "ops": sum(e.count for e in events) / profiled}))


def parent(args: argparse.Namespace) -> None:
    from benchmarks.harness import host_line, round_order

    results: dict[tuple[int, str], list[dict]] = {}
    for r in range(args.rounds):
        for batch in args.batches:
            for tree in round_order(args.trees, r):
                env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve() / "src"))
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(batch), "--steps",
                     str(args.steps)] + (["--table"] if args.table else []),
                    cwd=tree, env=env, check=True, capture_output=True, text=True)
                if args.table:
                    print(out.stderr)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((batch, tree), []).append(result)
                print(f"B={batch} {tree}: {result}", flush=True)
    print(f"\n{host_line()}; {args.rounds} rounds x {args.steps} steps\n")
    print(f"| B | tree | step ms (median of rounds' medians) | p10 ms | torch ops/step | "
          f"step time / {args.trees[0]}'s (median of rounds) |")
    print("|---|---|---|---|---|---|")
    for (batch, tree), runs in results.items():
        med = statistics.median(r["median_ms"] for r in runs)
        p10 = statistics.median(r["p10_ms"] for r in runs)
        first = results[batch, args.trees[0]]
        ratio = statistics.median(r["median_ms"] / f["median_ms"] for r, f in zip(runs, first))
        print(f"| {batch} | {tree} | {med:.2f} | {p10:.2f} | {runs[0]['ops']:.0f} | "
              f"{ratio:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--trees", nargs="+", default=["."])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.steps, args.table)
    else:
        parent(args)


if __name__ == "__main__":
    main()
