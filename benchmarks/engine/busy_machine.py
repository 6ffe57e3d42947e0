"""Decode speed on a machine that is busy with other work, per CPU thread policy.

For each policy (a fresh process each: libgomp reads OMP_WAIT_POLICY when torch loads), the
engine decodes at C = 1 (one request) and C = 32 (32 at once) while 0, 1, 2 and 4 competing
processes run: each a torch matmul loop on 2 threads with libgomp's default (spinning) wait
policy, i.e. another program of the same kind. The figure of merit is the slowdown against
the same policy on the quiet machine, beside the ratio of runnable threads to cores (what a
fair share would cost).

    flock /tmp/loom-bench.lock .venv/bin/python benchmarks/engine/busy_machine.py

Policies: `spin` = libgomp's default spin count (threads spin-wait for their peers before
sleeping), `passive` = OMP_WAIT_POLICY=PASSIVE (loom's default: they sleep at once),
`one-thread` = num_threads=1. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

LOADS = (0, 1, 2, 4)
# libgomp: with OMP_WAIT_POLICY unset a waiting thread spins 300,000 times before it sleeps
# (GOMP_SPINCOUNT, which takes precedence), what loom ran with before it set PASSIVE.
POLICIES = {"spin": ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"}, None),
            "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, None),
            "brief-spin": ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}, None),
            "one-thread": ({"OMP_WAIT_POLICY": "PASSIVE"}, 1)}
COMPETITOR = ("import torch; torch.set_num_threads(2); a = torch.randn(384, 384)\n"
              "while True: a @ a")
COMPETITOR_THREADS = 2


def competitors(n: int) -> list[subprocess.Popen]:
    """Other programs: libgomp's defaults, as any torch program has them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    return [subprocess.Popen([sys.executable, "-c", COMPETITOR], env=env) for _ in range(n)]


def measure(num_threads: int | None, tokens: int) -> dict[str, dict[str, float]]:
    """In this process: tokens/s at C = 1 and C = 32 under each load."""
    from loom import LLM, SamplingParams

    llm = LLM(kv_cache_memory="256MiB", num_threads=num_threads)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(["warm up"] * 4, params)
    results: dict[str, dict[str, float]] = {}
    for load in LOADS:
        procs = competitors(load)
        try:
            time.sleep(1.0 if load else 0.0)  # let them reach their loops
            row = {}
            for concurrency in (1, 32):
                prompts = [f"Request {i} tells a story:" for i in range(concurrency)]
                start = time.perf_counter()
                llm.generate(prompts, params)
                row[f"c{concurrency}"] = concurrency * tokens / (time.perf_counter() - start)
            results[str(load)] = row
        finally:
            for p in procs:
                p.kill()
                p.wait()
    return results


def run_policy(name: str, tokens: int) -> dict[str, dict[str, float]]:
    env_extra, num_threads = POLICIES[name]
    env = {**os.environ, **env_extra}
    command = [sys.executable, __file__, "--child", name, "--tokens", str(tokens)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="tokens decoded per request")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(POLICIES[args.child][1], args.tokens)))
        return

    from benchmarks.harness import host_line
    from loom import host

    cores = host.usable_cpus()
    print(f"{host_line()}\n")
    print("| policy | C | quiet tok/s | " + " | ".join(f"+{n} procs" for n in LOADS[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(LOADS) - 1))
    for name in args.policies.split(","):
        results = run_policy(name, args.tokens)
        threads = POLICIES[name][1] or cores
        for c in ("c1", "c32"):
            quiet = results["0"][c]
            cells = [f"{quiet / results[str(n)][c]:.1f}x slower "
                     f"(fair {max(1.0, (threads + n * COMPETITOR_THREADS) / cores):.1f}x)"
                     for n in LOADS[1:]]
            print(f"| {name} | {c[1:]} | {quiet:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
