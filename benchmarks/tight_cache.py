"""Preemption under a KV cache too small for the batch: the offline engine, plain and with async
scheduling, on prompts that share a prefix and grow past what the cache holds. Prints, per
mode, the preemptions, the wall time and the output tokens/s, and checks that both modes give
the same greedy text (preemption recomputes; it must not change an answer). Run from the
repository root, once per source tree to compare, e.g.:

    PYTHONPATH=/tmp/wt-base/src python benchmarks/tight_cache.py --label base
    python benchmarks/tight_cache.py --label head
"""

from __future__ import annotations

import argparse
import time

from loom import LLM, SamplingParams
from loom.host import describe

PREFIX = "You are a helpful assistant. Answer briefly and clearly. " * 3


def run(async_scheduling: bool, args: argparse.Namespace) -> tuple[int, float, list]:
    llm = LLM(num_kv_blocks=args.num_kv_blocks, max_model_len=256,
              async_scheduling=async_scheduling)
    prompts = [PREFIX + f"Question {i}: tell me about the number {i}."
               for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up, outside the timing
    before = llm.engine.scheduler.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return (llm.engine.scheduler.num_preemptions - before, seconds,
            [o.outputs[0].token_ids for o in outputs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="loom", help="the tree's name in the table")
    parser.add_argument("--num-kv-blocks", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    print(f"{describe()}; {args.num_prompts} prompts x {args.max_tokens} tokens, "
          f"{args.num_kv_blocks} KV blocks")
    print("| tree | scheduling | preemptions | seconds | out tok/s |\n|---|---|--:|--:|--:|")
    texts = {}
    for async_scheduling in (False, True):
        preemptions, seconds, texts[async_scheduling] = run(async_scheduling, args)
        mode = "async" if async_scheduling else "plain"
        tokens = args.num_prompts * args.max_tokens
        print(f"| {args.label} | {mode} | {preemptions} | {seconds:.2f} | "
              f"{tokens / seconds:.1f} |")
    assert texts[False] == texts[True], "async scheduling changed a greedy answer"


if __name__ == "__main__":
    main()
