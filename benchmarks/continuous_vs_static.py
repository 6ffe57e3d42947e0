"""Continuous batching vs the fixed-batch baseline on the mixed workload (engine issue).

Runs the same 64 requests through `LLM(scheduler="continuous")` and `LLM(scheduler="static")`
at the same max_num_seqs, alternating A B A B so drift on a shared machine hits both, and
reports medians: useful output tokens/s, mean completion time, and single-request decode
tokens/s. Usage:

    python benchmarks/continuous_vs_static.py --max-num-seqs 16 --rounds 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from workload import bundled_tokenizer, mixed_workload

from loom import LLM, SamplingParams


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()

    items = mixed_workload(bundled_tokenizer(), n=args.num_requests, seed=0)
    common = dict(max_num_seqs=args.max_num_seqs, kv_cache_memory="3GiB",
                  max_num_batched_tokens=args.max_num_batched_tokens)
    engines = {name: LLM(scheduler=name, **common) for name in ("continuous", "static")}
    for llm in engines.values():
        run_once(llm, items[:4])  # warm-up
    results: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            llm.engine.kv_cache.pool.reset_prefix_cache()
            results[name].append(run_once(llm, items))
            print(f"round {r + 1} {name}: {results[name][-1]}", flush=True)
    decode = single_decode_tok_s(engines["continuous"])

    med = {name: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
           for name, runs in results.items()}
    ratio = med["continuous"]["tok_s"] / med["static"]["tok_s"]
    print(f"\nhardware: {platform.processor() or platform.machine()}, "
          f"{len(__import__('os').sched_getaffinity(0))} cores")
    print(f"{args.num_requests} mixed requests, max_num_seqs={args.max_num_seqs}, "
          f"max_num_batched_tokens={args.max_num_batched_tokens}, medians of {args.rounds}")
    print("| scheduler | useful output tok/s | mean completion time (s) | wall (s) |")
    print("|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['tok_s']:.1f} | {m['mean_completion_s']:.2f} | {m['wall_s']:.1f} |")
    print(f"\ncontinuous / static useful tok/s: {ratio:.2f}x")
    print(f"single-request decode: {decode:.1f} tok/s")


if __name__ == "__main__":
    main()
