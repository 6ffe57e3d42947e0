"""Exploratory, for the speed issue: bfloat16 vs float32 weights on this CPU.

Prints the bf16 engine's answer to a chat question, how many of 24 greedy tokens of 4 prompts
match the fp32 engine, single-request decode tok/s in bf16, and the mixed workload (continuous
vs static at max_num_seqs 8 and 16) in bf16. Run from the repository root:

    python benchmarks/bf16_vs_fp32.py
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, "benchmarks")
from workload import bundled_tokenizer, mixed_workload  # noqa: E402

from loom import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5, 6,",
           "Water boils at"]


def main() -> None:
    items = mixed_workload(bundled_tokenizer())
    fp32 = LLM(dtype="float32", kv_cache_memory="256MiB")
    bf16 = LLM(dtype="bfloat16", kv_cache_memory="256MiB")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    print(repr(bf16.chat(chat, SamplingParams(max_tokens=30, temperature=0))[0].outputs[0].text))
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for a, b in zip(fp32.generate(PROMPTS, greedy), bf16.generate(PROMPTS, greedy)):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        same = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        print("tokens equal to fp32 before the first difference:", same)
    start = time.time()
    bf16.generate(["Tell me a story."], SamplingParams(max_tokens=64, ignore_eos=True,
                                                       temperature=0))
    print(f"bf16 single-request decode: {64 / (time.time() - start):.1f} tok/s")
    tokens = sum(i.max_tokens for i in items)
    for max_num_seqs in (8, 16):
        for scheduler in ("continuous", "static"):
            llm = LLM(dtype="bfloat16", scheduler=scheduler, max_num_seqs=max_num_seqs,
                      kv_cache_memory="1GiB")
            params = [SamplingParams(max_tokens=i.max_tokens, temperature=0, ignore_eos=True)
                      for i in items]
            start = time.time()
            llm.generate([i.prompt_token_ids for i in items], params)
            wall = time.time() - start
            print(f"max_num_seqs={max_num_seqs} {scheduler}: {tokens / wall:.1f} tok/s, "
                  f"wall {wall:.1f} s", flush=True)


if __name__ == "__main__":
    main()
