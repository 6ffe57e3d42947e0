"""Fleets of 10 / 100 / 1,000 simulated replicas under prefix-aware and load-only routing.

Traffic with many shared prefixes (agents' system prompts, RAG documents): each request is one
of `--documents` prefixes, drawn Zipf-like (a few popular, a long tail), followed by its own
question. Per-replica load is held constant while the fleet grows, so the figures show what the
router alone changes: prefix-cache hit rate, TTFT, and how many replicas each policy needs to
meet a TTFT SLO at one total rate.

It is a simulation: the real scheduler and KV cache manager of every replica on a roofline step
model of the GPU (`loom simulate --gpus`), routed by the cluster's own policy code
(`loom.cluster.routing`). Nothing here was run on GPUs.

Steady state: every replica starts with a cold cache, so the first seconds are all misses and
the last ones drain. TTFT figures count only the requests sent between `--warmup-s` and the
last arrival (the warm-up and the drain excluded); the hit rate is the whole run's (cold start
included) and so a floor on the steady one. Run long enough (`--requests-per-replica`) that
the window holds most of the requests: 240 per replica at 8 req/s is 30 s, 25 of them counted.

    python benchmarks/planning/fleet_sim.py --sizes 10,100 --requests-per-replica 240 \
        --warmup-s 5 --slo-size 10 --output-len 32
"""

from __future__ import annotations

import argparse
import random
import time
from array import array
from collections.abc import Sequence
from typing import Any

from loom.config import EngineConfig, ModelConfig
from loom.host import describe
from loom.plan.planner import PlanFlags
from loom.sim.configs import SimSetup, sim_configs
from loom.sim.replay import Simulation
from loom.sim.result import build
from loom.workload.load import Load
from loom.workload.results import utc_now
from loom.workload.trace import Trace, TraceRequest


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10,100,1000", help="fleet sizes (replicas)")
    p.add_argument("--routers", default="prefix,pow2")
    p.add_argument("--per-replica-rate", type=float, default=8.0, help="req/s per replica")
    p.add_argument("--requests-per-replica", type=int, default=60)
    p.add_argument("--documents-per-replica", type=float, default=2.0,
                   help="distinct prefixes in the traffic, per replica of the fleet")
    p.add_argument("--prefix-len", type=int, default=2048, help="tokens of each shared prefix")
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--slo-size", type=int, default=100,
                   help="fleet size whose total rate the replicas-for-an-SLO search uses "
                        "(0: no search)")
    p.add_argument("--slo-ttft-p95", type=float, default=0.5, help="seconds")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--gpu", default="h100-sxm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-s", type=float, default=5.0,
                   help="simulated seconds of cold cache excluded from the TTFT figures")
    return p.parse_args()


class _Prompts(Sequence[list[int]]):
    """Each request's prompt, its document's id list (shared, not copied) followed by its own
    question, built only when the simulation sends it: 1,000 replicas' traffic held as lists
    up front is 400,000 prompts of 2,112 ids, about 7 GB of pointers. Ids are counters, not
    random draws (the scheduler and router need only equality): document d's prefix is
    d * prefix_len onwards, request i's question i * question_len onwards past every prefix."""

    def __init__(self, docs: list[int], num_documents: int, prefix_len: int,
                 question_len: int) -> None:
        self.docs, self.question_len = array("l", docs), question_len
        self.prefixes = [list(range(d * prefix_len, (d + 1) * prefix_len))
                         for d in range(num_documents)]
        self.first_question_id = num_documents * prefix_len

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        start = self.first_question_id + i * self.question_len
        return self.prefixes[self.docs[i]] + list(range(start, start + self.question_len))


def _traffic(args: argparse.Namespace, num_requests: int, num_documents: int
             ) -> tuple[Trace, _Prompts]:
    """Requests over Zipf-popular documents (weight 1 / rank), each its document's prefix
    then a question of its own."""
    rng = random.Random(args.seed)
    weights = [1 / (rank + 1) for rank in range(num_documents)]
    docs = rng.choices(range(num_documents), weights, k=num_requests)
    requests = [TraceRequest(max_tokens=args.output_len,
                             prompt_len=args.prefix_len + args.question_len,
                             cls="shared-prefix", id=str(i)) for i in range(num_requests)]
    return (Trace(requests, {"tokenizer": "synthetic"}, sha256="0" * 64),
            _Prompts(docs, num_documents, args.prefix_len, args.question_len))


def _config(args: argparse.Namespace) -> Any:
    """The roofline configuration of one replica, as `loom simulate --gpus` makes it."""
    engine = EngineConfig(ModelConfig(model=args.model, max_model_len=8192))
    return sim_configs(SimSetup(engine, gpus=PlanFlags(gpus=(args.gpu,))))[0][0]


def _run(config: Any, trace: Trace, ids: Sequence[list[int]], replicas: int, router: str,
         rate: float, seed: int, warmup_s: float = 0.0) -> dict[str, Any]:
    """One fleet's run; `steady_*`: TTFT of the requests sent after `warmup_s` and before
    the last arrival (the cold start and the drain left out)."""
    import dataclasses

    fleet = dataclasses.replace(config, name=f"x{replicas}-{router}", replicas=replicas,
                                router=router)
    wall = time.perf_counter()
    run = Simulation(fleet.engines(), trace, ids, Load(rate=rate, seed=seed), fleet.limits,
                     1.0, fleet.routing_policy(seed)).simulate()
    wall = time.perf_counter() - wall
    last = max(r.scheduled_s for r in run.sent)
    steady = sorted(r.ttft_s for r in run.sent
                    if r.ttft_s is not None and warmup_s <= r.start_s <= last)
    result = build(run, fleet, trace, Load(rate=rate, seed=seed), None, fleet.name,
                   utc_now(), wall, 0.0).to_json()
    return {**result, "wall_s": wall, "steady_requests": len(steady),
            "steady_mean_ttft_ms": 1e3 * sum(steady) / max(1, len(steady)),
            "steady_p95_ttft_ms": 1e3 * steady[int(0.95 * (len(steady) - 1))] if steady
            else float("nan")}


def _row(result: dict[str, Any], replicas: int, router: str) -> str:
    sim = result["simulation"]
    per = sim["requests_per_replica"]
    return (f"| {replicas:,} | {router} | {result['request_rate']:.0f} | "
            f"{result['prefix_cache_hit_rate']:.1%} | {result['steady_mean_ttft_ms']:.0f} | "
            f"{result['steady_p95_ttft_ms']:.0f} | {result['p95_ttft_ms']:.0f} | "
            f"{result['steady_requests']:,} of {result['completed']:,} | {max(per)} / {min(per)} "
            f"| {result['duration']:.0f} s in {result['wall_s']:.0f} s |")


def main() -> None:
    args = _args()
    config = _config(args)
    print(f"# host: {describe()}; model {args.model} on {args.gpu} (roofline), "
          f"{config.num_kv_blocks} KV blocks per replica")
    print(f"\n| replicas | router | offered req/s | prefix hit rate (whole run) | steady mean "
          f"TTFT ms | steady p95 TTFT ms | p95 TTFT ms, cold start included | requests counted "
          f"(after {args.warmup_s:g} s, before the drain) of completed | requests per replica "
          "max / min | simulated in wall |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|--|--|")
    routers = args.routers.split(",")
    for size in (int(x) for x in args.sizes.split(",")):
        trace, ids = _traffic(args, size * args.requests_per_replica,
                              max(1, round(size * args.documents_per_replica)))
        for router in routers:
            result = _run(config, trace, ids, size, router, size * args.per_replica_rate,
                          args.seed, args.warmup_s)
            print(_row(result, size, router), flush=True)
    _replicas_for_slo(args, config, routers)


def _replicas_for_slo(args: argparse.Namespace, config: Any, routers: list[str]) -> None:
    """At the total rate of `--slo-size` replicas, the fewest replicas whose p95 TTFT meets
    the SLO, per router: bisection between a tenth and four times that size, to within a
    twentieth of it."""
    size = args.slo_size
    if size <= 0:
        return
    rate = size * args.per_replica_rate
    trace, ids = _traffic(args, size * args.requests_per_replica,
                          max(1, round(size * args.documents_per_replica)))
    print(f"\nReplicas needed for steady-state p95 TTFT <= {args.slo_ttft_p95:g} s at "
          f"{rate:.0f} req/s (the traffic of {size} replicas above; the first "
          f"{args.warmup_s:g} s and the drain excluded):\n")
    print("| router | replicas tried: p95 TTFT ms | fewest meeting the SLO |")
    print("|---|---|--:|")
    for router in routers:
        tried: dict[int, float] = {}

        def meets(replicas: int, router: str = router, tried: dict[int, float] = tried) -> bool:
            result = _run(config, trace, ids, replicas, router, rate, args.seed, args.warmup_s)
            tried[replicas] = result["steady_p95_ttft_ms"]
            return result["steady_p95_ttft_ms"] <= args.slo_ttft_p95 * 1000

        low, high = max(1, size // 10), 4 * size
        if not meets(high):
            fewest: int | str = f"more than {high}"
        else:
            while high - low > max(1, size // 20):
                middle = (low + high) // 2
                low, high = (low, middle) if meets(middle) else (middle, high)
            fewest = high
        steps = ", ".join(f"{n}: {ms:.0f}" for n, ms in sorted(tried.items()))
        print(f"| {router} | {steps} | {fewest} |", flush=True)


if __name__ == "__main__":
    main()
