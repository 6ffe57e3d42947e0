"""Prefill on a CPU with native bf16: what long chunks' attention and fresh KV blocks cost.

Three parts, each printed as a Markdown table:

* sdpa: torch's SDPA at the bundled model's attention shape (9 query heads over 3 kv heads,
  head_dim 64) in float32 and in bfloat16 (inputs cast, output cast back, as
  `loom.model.attention` does from BF16_PREFILL_MIN_POSITIONS), for whole causal prompts and
  for chunks after a cached prefix (boolean mask), medians of 10;
* prefill: whole prompts of N tokens (one request, max_tokens 1, prefix caching off) through
  `LLM.generate`, medians of 5 after two warm-ups, with the default settings;
* accuracy: a long passage teacher-forced through the model's own prefill (one chunk, as the
  engine's prefill runs it) in float32 throughout (`batched_matmul="native"`) and in the auto
  setting with long-chunk bf16 attention off and on: each one's top-1 agreement and KL
  against float32, and perplexity (skipped on a checkout without the setting).

The prefill part uses only what older checkouts have too, so a before/after is this script
run from each tree (`PYTHONPATH=<tree>/src`), alternating; it is how the KV cache's huge
pages (`loom.model.attention.zeros`) were measured: a first-touch microbenchmark of the two
allocations moved 0.07-1.2 s a GiB from run to run either way on a virtual machine. Run
from the repository root:

    python benchmarks/prefill_attention.py
    python benchmarks/prefill_attention.py --parts prefill --lengths 500 1000 2000
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import loom  # noqa: F401 - before torch: it sets the OpenMP wait policy (loom/threads.py)

# isort: split
import torch
import torch.nn.functional as F

from loom import LLM, SamplingParams, host
from loom.model import attention

sys.path.insert(0, "benchmarks")
from roofline import best_and_median  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def median_ms(fn: Callable[[], object], repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup - 1):  # best_and_median runs one more
        fn()
    return best_and_median(fn, repeats)[1] * 1e3


def sdpa_part() -> None:
    print("| query tokens | context | fp32 ms | bf16 ms | fp32 / bf16 |\n|--:|--:|--:|--:|--:|")
    cases = [(n, n) for n in (128, 256, 384, 512, 1024, 2048)]
    cases += [(128, 2048), (256, 1024), (512, 2048)]
    for query, context in cases:
        q = torch.randn(1, HEADS, query, HEAD_DIM)
        k, v = (torch.randn(1, KV_HEADS, context, HEAD_DIM) for _ in range(2))
        mask = None if query == context else (
            torch.arange(context).unsqueeze(0) <= torch.arange(query).unsqueeze(1)
            + context - query)

        def run(dtype: torch.dtype, q: torch.Tensor = q, k: torch.Tensor = k,
                v: torch.Tensor = v, mask: torch.Tensor | None = mask) -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, is_causal=mask is None,
                enable_gqa=True).float()

        fp32, bf16 = (median_ms(lambda d=d: run(d)) for d in (torch.float32, torch.bfloat16))
        print(f"| {query} | {context} | {fp32:.2f} | {bf16:.2f} | {fp32 / bf16:.2f}x |")


def prefill_part(lengths: list[int]) -> None:
    llm = LLM(enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0)
    print("| prompt tokens | prefill ms | tok/s |\n|--:|--:|--:|")
    for n in lengths:
        prompt = [1000 + i % 20000 for i in range(n)]
        ms = median_ms(lambda p=prompt: llm.generate([p], params), repeats=5, warmup=2)
        print(f"| {n} | {ms:.0f} | {n / ms * 1e3:.0f} |")


@torch.inference_mode()
def accuracy_part() -> None:
    if "prefill_bf16" not in attention.AttentionMetadata.__dataclass_fields__:
        print("(accuracy: this checkout has no long-chunk bf16 attention; skipped)")
        return
    from dtype_accuracy import PASSAGES, compare_logits, encode, passage_logits

    fp32 = LLM(enable_prefix_caching=False, batched_matmul="native")  # float32 throughout
    auto = LLM(enable_prefix_caching=False)
    ids: list[int] = []
    for passage in PASSAGES.values():
        ids += encode(auto.tokenizer, passage, generation=False)
    reference = passage_logits(fp32.engine.runner.model, ids, torch.float16)
    base = compare_logits(reference, reference, ids)
    print(f"Against float32 throughout (`batched_matmul=native`), {len(ids)} tokens in one "
          "chunk, fp16 KV cache:\n\n| run | top-1 agreement | mean KL | max KL | perplexity |"
          "\n|---|--:|--:|--:|--:|\n| float32 throughout | - | - | - | "
          f"{math.exp(base['nll_ref'] / base['positions']):.4f} |")
    for name, flag in (("auto, attention float32", False),
                       ("auto, long-chunk attention bf16", True)):
        test = passage_logits(auto.engine.runner.model, ids, torch.float16, prefill_bf16=flag)
        r = compare_logits(reference, test, ids)
        print(f"| {name} | {r['top1_agree'] / r['positions']:.2%} | "
              f"{r['kl_sum'] / r['positions']:.2e} | {r['kl_max']:.2e} | "
              f"{math.exp(r['nll_test'] / r['positions']):.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["sdpa", "prefill", "accuracy"],
                        choices=["sdpa", "prefill", "accuracy"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 500, 1000, 2000])
    args = parser.parse_args()
    print(f"host: {host.describe()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    for part in args.parts:
        if part == "prefill":
            prefill_part(args.lengths)
        else:
            {"sdpa": sdpa_part, "accuracy": accuracy_part}[part]()
        print()


if __name__ == "__main__":
    main()
