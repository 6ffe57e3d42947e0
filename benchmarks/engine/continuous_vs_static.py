"""Continuous batching vs the fixed-batch baseline on the mixed workload (engine issue).

Runs the same 64 requests through `LLM(scheduler="continuous")` and `LLM(scheduler="static")`
at the same max_num_seqs, alternating A B, B A so drift on a shared machine hits both, and
reports medians: useful output tokens/s, mean completion time, and single-request decode
tokens/s. Usage:

    python benchmarks/engine/continuous_vs_static.py --max-num-seqs 8,16,32 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.engine.workload import bundled_tokenizer, mixed_workload  # noqa: E402
from benchmarks.harness import host_line, round_order  # noqa: E402
from loom import LLM, SamplingParams  # noqa: E402


def run_once(llm: LLM, items: list) -> dict[str, float]:
    params = [SamplingParams(max_tokens=i.max_tokens, temperature=0.0, ignore_eos=True)
              for i in items]
    start = time.monotonic()
    outputs = llm.generate([i.prompt_token_ids for i in items], params)
    elapsed = time.monotonic() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    completion = [o.metrics.finished_time - start for o in outputs]
    return {"tok_s": tokens / elapsed, "mean_completion_s": statistics.mean(completion),
            "wall_s": elapsed, "tokens": tokens}


def single_decode_tok_s(llm: LLM, n: int = 128) -> float:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    start = time.monotonic()
    llm.generate(["Tell me a long story about a lighthouse keeper."], params)
    return n / (time.monotonic() - start)


def compare(items: list, max_num_seqs: int, args: argparse.Namespace) -> dict[str, dict]:
    """Medians per scheduler at one max_num_seqs, runs interleaved A B B A."""
    common = dict(max_num_seqs=max_num_seqs, kv_cache_memory="1536MiB",
                  max_num_batched_tokens=args.max_num_batched_tokens)
    engines = {name: LLM(scheduler=name, **common) for name in ("continuous", "static")}
    for llm in engines.values():
        run_once(llm, items[:4])  # warm-up
    results: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in round_order(list(engines), r):
            llm = engines[name]
            llm.engine.kv_cache.pool.reset_prefix_cache()
            results[name].append(run_once(llm, items))
            print(f"max_num_seqs={max_num_seqs} round {r + 1} {name}: {results[name][-1]}",
                  flush=True)
    return {name: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
            for name, runs in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-num-seqs", default="16",
                        help="comma-separated values; each compares both schedulers")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()

    items = mixed_workload(bundled_tokenizer(), n=args.num_requests, seed=0)
    table = {int(m): compare(items, int(m), args) for m in args.max_num_seqs.split(",")}
    decode = single_decode_tok_s(LLM(kv_cache_memory="256MiB"))

    print(f"\n{host_line()}; {args.num_requests} mixed requests, "
          f"max_num_batched_tokens={args.max_num_batched_tokens}, medians of {args.rounds}")
    print("| max_num_seqs | scheduler | useful output tok/s | mean completion (s) | wall (s) "
          "| continuous / static |")
    print("|---|---|---|---|---|---|")
    for m, med in table.items():
        ratio = med["continuous"]["tok_s"] / med["static"]["tok_s"]
        for name, x in med.items():
            shown = f"{ratio:.2f}x" if name == "continuous" else ""
            print(f"| {m} | {name} | {x['tok_s']:.1f} | {x['mean_completion_s']:.2f} "
                  f"| {x['wall_s']:.1f} | {shown} |")
    print(f"\nsingle-request decode: {decode:.1f} tok/s")


if __name__ == "__main__":
    main()
