"""The CPU dtype choices side by side, offline: what auto picks on this CPU, plain float32 on
the native kernel, and bfloat16 (fast only where the CPU has native bf16 instructions).

For each, in alternating rounds in one process (this machine's speed drifts by the minute,
so only figures of one round are compared): the prefill of one long prompt (ms, median of
three), one user's decode (64 greedy tokens after a short prompt, tok/s) and the engine
issue's 64-request mixed workload at max_num_seqs 32 (output tok/s, continuous batching; a
new draw of it each round, the same for every config).
Run from the repository root:

    python benchmarks/engine/cpu_dtypes.py                  # about 3 minutes on 2 cores
    python benchmarks/engine/cpu_dtypes.py --rounds 1 --configs auto float32
    python benchmarks/engine/cpu_dtypes.py --model HF_FOLDER --max-num-seqs 8 --requests 24
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.engine.workload import bundled_tokenizer, mixed_workload, run_offline  # noqa: E402
from benchmarks.harness import host_line, round_order  # noqa: E402
from loom import LLM, SamplingParams  # noqa: E402

CONFIGS = {"auto": {}, "float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}}


def prefill_ms(llm: LLM, prompt_len: int, seed: int) -> float:
    """Median of three prompts no earlier call has seen (the prefix cache holds none of it)."""
    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for rep in range(3):
        first = 1000 + 7919 * (3 * seed + rep) % 30000
        prompt = [first + (j * 104729) % 10000 for j in range(prompt_len)]
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def one_user_tok_s(llm: LLM, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(["Tell me a story."], SamplingParams(max_tokens=2, temperature=0))
    start = time.perf_counter()
    llm.generate(["Tell me a story."], params)
    return tokens / (time.perf_counter() - start)


def mixed_tok_s(llm: LLM, items: list[Any]) -> float:
    wall = run_offline(llm.engine, items)
    return sum(i.max_tokens for i in items) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--model", help="default: the bundled GGUF (its vocabulary is used)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64, help="of the mixed workload")
    args = parser.parse_args()
    tokenizer = bundled_tokenizer()
    engines = {name: LLM(args.model, kv_cache_memory="1GiB", max_num_seqs=args.max_num_seqs,
                         **CONFIGS[name])
               for name in args.configs}
    print(host_line())
    for name, llm in engines.items():
        print(f"{name}: {llm.engine.runner.backends.describe()}")
    print(f"\n| round | config | prefill of {args.prompt_len} tokens, ms | one user, tok/s "
          f"| mixed, {args.max_num_seqs} seqs, tok/s |")
    print("|--:|---|--:|--:|--:|")
    for round_ in range(1, args.rounds + 1):
        order = round_order(args.configs, round_ - 1)
        # new prompts: no cached prefill
        items = mixed_workload(tokenizer, args.requests, seed=round_)
        for name in order:
            llm = engines[name]
            row = (prefill_ms(llm, args.prompt_len, round_), one_user_tok_s(llm, 64),
                   mixed_tok_s(llm, items))
            print(f"| {round_} | {name} | {row[0]:.0f} | {row[1]:.1f} | {row[2]:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
