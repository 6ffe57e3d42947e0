"""What each matmul setting costs in quality, and whether its answers depend on the batch:
teacher-forced next-token predictions of a text against a float32 reference (`--dtype float32
--batched-matmul native --kv-cache-dtype float32`) at 1 and 32 sequences sharing the step, and
10 everyday prompts decoded greedily alone and together; with --speed, instead, the
settings' output tok/s side by side (stepped in turn, workload.interleaved_rounds) on the
engine issue's mixed workload at 1, 8 and 32 users (max_num_seqs; 8, 8 and 32 requests).
Run from the repository root:

    python benchmarks/engine/batch_invariance.py                 # about 3 minutes on 2 cores
    python benchmarks/engine/batch_invariance.py --text README.md --pieces 16
    flock /tmp/loom-bench.lock python benchmarks/engine/batch_invariance.py --speed

Top-1 agreement: the share of positions where the setting's most likely token is the
reference's. KLD: mean over positions of the KL divergence from the reference's distribution
over its top 20 tokens (what prompt logprobs return; a token past the setting's top 20 counts
at the setting's 20th logprob, an upper bound), so it slightly undercounts the full KLD.
`loom eval kld` computes the full one. Quality is not a timing: only --speed needs the lock.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.engine.workload import (  # noqa: E402
    bundled_tokenizer,
    interleaved_rounds,
    mixed_workload,
)
from benchmarks.harness import host_line, medians  # noqa: E402
from loom import LLM, SamplingParams  # noqa: E402

REFERENCE = {"dtype": "float32", "batched_matmul": "native", "kv_cache_dtype": "float32"}
SETTINGS = {
    "bf16 copies (batched_matmul bfloat16)": {"batched_matmul": "bfloat16"},
    "native (batched_matmul native)": {"batched_matmul": "native"},
    "batch_invariant": {"batch_invariant": True},
}
PROMPTS = [
    "What is the capital of France?", "Give me three tips for staying healthy.",
    "Write a haiku about autumn leaves.", "Explain what a rainbow is to a child.",
    "How do I boil an egg?", "What is 17 times 23?", "Name three animals that live in the ocean.",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Suggest a name for a small bakery.",
]
Predictions = list[list[dict[int, float]]]


def pieces(llm: LLM, text: str, count: int, length: int) -> list[list[int]]:
    """`count` consecutive pieces of `length` tokens of the text (each scored on its own)."""
    ids = llm.tokenizer.encode(text)
    if len(ids) < count * length:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def predictions(llm: LLM, prompts: list[list[int]], together: bool) -> Predictions:
    """The top-20 next-token logprobs at every position of each prompt, teacher-forced; all
    in one call (sharing steps) or one prompt a call."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20)
    batches = [prompts] if together else [[p] for p in prompts]
    outs = [o for batch in batches for o in llm.generate(batch, params)]
    return [[dict(e.top) for e in o.prompt_logprobs[1:]] for o in outs]


def compare(reference: Predictions, other: Predictions) -> tuple[float, float]:
    """(top-1 agreement, mean KLD over the reference's top 20): module docstring."""
    agree, kld, count = 0, 0.0, 0
    for ref_rows, rows in zip(reference, other):
        for ref, row in zip(ref_rows, rows):
            agree += max(ref, key=ref.get) == max(row, key=row.get)
            floor = min(row.values())
            kld += sum(math.exp(lp) * (lp - row.get(t, floor)) for t, lp in ref.items())
            count += 1
    return agree / count, kld / count


def alone_vs_together(llm: LLM, max_tokens: int = 32) -> int:
    """How many of the 10 prompts' greedy answers are the same alone and in one batch."""
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    alone = [llm.chat([c], params)[0].outputs[0].token_ids for c in chats]
    together = [o.outputs[0].token_ids for o in llm.chat(chats, params)]
    return sum(list(a) == list(b) for a, b in zip(alone, together))


def speed(users: list[int], rounds: int) -> None:
    """Output tok/s of every setting at each number of users, stepped in turn."""
    tokenizer = bundled_tokenizer()
    print("\n| users | requests | " + " | ".join(SETTINGS) + " |\n|--:|--:|"
          + "--:|" * len(SETTINGS))
    for n in users:
        items = mixed_workload(tokenizer, n=max(8, n))
        engines = {name: LLM(kv_cache_memory="1GiB", max_num_seqs=n, **setting).engine
                   for name, setting in SETTINGS.items()}
        rates = medians(interleaved_rounds(engines, items, rounds))
        print(f"| {n} | {len(items)} | "
              + " | ".join(f"{rates[name]:.1f}" for name in SETTINGS) + " |", flush=True)
        del engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default="docs/architecture.md")
    parser.add_argument("--pieces", type=int, default=32)
    parser.add_argument("--length", type=int, default=256, help="tokens a piece")
    parser.add_argument("--speed", action="store_true", help="tok/s instead of quality")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(host_line())
    if args.speed:
        speed(args.users, args.rounds)
        return
    common = {"kv_cache_memory": "512MiB", "max_model_len": 2048, "max_num_seqs": 32}
    reference = LLM(**common, **REFERENCE)
    text = pieces(reference, Path(args.text).read_text(), args.pieces, args.length)
    print(f"text: {args.text}, {args.pieces} pieces of {args.length} tokens")
    ref = {together: predictions(reference, text, together) for together in (False, True)}
    print(f"reference: {reference.engine.runner.backends.describe()}; same alone and together "
          f"{alone_vs_together(reference)}/10")
    del reference
    print("\n| setting | top-1, batch 1 | KLD, batch 1 | top-1, 32 seqs | KLD, 32 seqs "
          "| same alone/together |\n|---|--:|--:|--:|--:|--:|")
    for name, setting in SETTINGS.items():
        llm = LLM(**common, **setting)
        cells = []
        for together in (False, True):
            top1, kld = compare(ref[together], predictions(llm, text, together))
            cells += [f"{top1:.2%}", f"{kld:.2e}"]
        print(f"| {name} | {' | '.join(cells)} | {alone_vs_together(llm)}/10 |", flush=True)


if __name__ == "__main__":
    main()
