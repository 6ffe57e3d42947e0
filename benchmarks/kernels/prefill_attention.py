"""Prefill attention: what long chunks' attention, short chunks' and fresh KV blocks cost.

Five parts, each printed as a Markdown table:

* sdpa: torch's SDPA at the bundled model's attention shape (9 query heads over 3 kv heads,
  head_dim 64) in float32 and in bfloat16 (inputs cast, output cast back, as
  `loom.model.attention` does from BF16_PREFILL_MIN_POSITIONS), for whole causal prompts and
  for chunks after a cached prefix (boolean mask), medians of 10;
* prefill: whole prompts of N tokens (one request, max_tokens 1, prefix caching off) through
  `LLM.generate`, medians of 5 after two warm-ups, with the default settings;
* accuracy: a long passage teacher-forced through the model's own prefill (one chunk, as the
  engine's prefill runs it) in float32 throughout (`batched_matmul="native"`) and in the auto
  setting with long-chunk bf16 attention off and on: each one's top-1 agreement and KL
  against float32, and perplexity (skipped on a checkout without the setting);
* per-token: a chunk of Q tokens after P cached ones, over an fp16 paged cache, two ways: the
  SDPA call `loom.model.attention` makes for a prefill span (bf16 where the engine would
  choose it) and the native decode kernel with one query row per token, each over the blocks
  up to its own position (how the runner sends chunks of fewer query x context positions than
  `Backends.per_token_prefill_max_positions`), medians of 15; with `--against REV` also the
  decode kernel's source at git revision REV, compiled beside today's and timed on the same
  inputs in turns (decode_kernel.py's `alternating`), for a before/after ratio;
* burst: the 64 prompts of benchmarks/traces/mixed-64.jsonl submitted at once, as a closed
  loop of 64 users starts: prefill only (max_tokens 1), then the whole trace with its output
  lengths (ignore_eos), twice each in one process, every round's prompts behind a prefix of
  its own so that no round reuses another's cached blocks (within a round they share
  documents as the trace does).

The prefill and burst parts use only what older checkouts have too, so a before/after is this
script run from each tree (`PYTHONPATH=<tree>/src`), alternating; it is how the KV cache's huge
pages (`loom.model.attention.zeros`) were measured: a first-touch microbenchmark of the two
allocations moved 0.07-1.2 s a GiB from run to run either way on a virtual machine. Run
from the repository root:

    python benchmarks/kernels/prefill_attention.py
    python benchmarks/kernels/prefill_attention.py --parts prefill --lengths 500 1000 2000
    python benchmarks/kernels/prefill_attention.py --parts per-token burst
    python benchmarks/kernels/prefill_attention.py --parts per-token --against HEAD~1
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import alternating, best_and_median, host_line  # noqa: E402

# isort: split
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.kernels.decode_kernel import kernel_at  # noqa: E402
from loom import LLM, SamplingParams, host  # noqa: E402
from loom.model import attention  # noqa: E402
from loom.model.kernels import paged_attention_ops  # noqa: E402
from loom.workload.trace import load_trace  # noqa: E402

MIXED_64 = Path(__file__).resolve().parents[1] / "traces" / "mixed-64.jsonl"

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def median_ms(fn: Callable[[], object], repeats: int = 10, warmup: int = 3) -> float:
    return best_and_median(fn, repeats, warmup)[1] * 1e3


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


def per_token_part(against: str | None) -> None:
    caches = attention.new_kv_cache(520, 16, KV_HEADS, HEAD_DIM, torch.float16,
                                    torch.device("cpu"))
    for cache in caches:
        cache.copy_(torch.randn(cache.shape))
    old = kernel_at(against) if against else None
    extra = f" per-token at {against} ms | now / {against} |" if old else ""
    print("| chunk tokens | cached before | positions | SDPA ms | per-token ms | per-token / SDPA "
          f"|{extra}\n|--:|--:|--:|--:|--:|--:|" + ("--:|--:|" if old else ""))
    for cached in (0, 64, 256, 1024, 2048, 4096, 6144):
        for query in (8, 32, 64, 128, 256, 512, 1024, 2048):
            if cached + query > 8192 or (query < 256 and cached > 1024):
                continue  # past the cache, or far below both bounds
            sdpa, rows, rows_old = _per_token_case(query, cached, caches, old)
            row = (f"| {query} | {cached} | {query * (cached + query):,} | {sdpa:.3f} | "
                   f"{rows:.3f} | {rows / sdpa:.2f}x |")
            if rows_old is not None:
                row += f" {rows_old:.3f} | {rows / rows_old:.2f}x |"
            print(row, flush=True)


def _per_token_case(query: int, cached: int, caches: tuple[torch.Tensor, torch.Tensor],
                    old: ModuleType | None) -> tuple[float, float, float | None]:
    """(SDPA ms, per-token rows ms, the same rows on `old`'s kernel ms) for one chunk over
    blocks drawn at random."""
    k_cache, v_cache = caches
    context = cached + query
    blocks = torch.randperm(k_cache.shape[0])[:-(-context // k_cache.shape[1])]
    q = torch.randn(query, HEADS, HEAD_DIM)
    k, v = (torch.randn(query, KV_HEADS, HEAD_DIM) for _ in range(2))
    out = torch.empty_like(q)
    meta = attention.AttentionMetadata(  # bf16 where Backends.bf16_prefill_attention says
        slots=(blocks, blocks), decodes=[], prefill_bf16=host.has_amx(),
        prefills=[attention.PrefillSpan(0, query, context, blocks)])
    tables = blocks.expand(query, -1).contiguous()
    lens = torch.arange(cached + 1, context + 1)
    sdpa = median_ms(lambda: attention._attend_prefills(q, k, v, k_cache, v_cache, meta, out),
                     repeats=15)
    def per_token_rows(ops: ModuleType) -> float:
        return median_ms(lambda: ops.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5), repeats=15)

    if old is None:
        return sdpa, per_token_rows(paged_attention_ops()), None
    rows, rows_old = alternating([lambda: per_token_rows(paged_attention_ops()),
                                  lambda: per_token_rows(old)], rounds=4)
    return sdpa, rows, rows_old


def burst_part() -> None:
    requests = load_trace(MIXED_64).requests
    llm = LLM()
    llm.generate(["warm-up"], SamplingParams(max_tokens=2))
    first = SamplingParams(max_tokens=1, temperature=0)
    whole = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
             for r in requests]
    print("| round | prefill only ms | whole trace ms | output tok/s |\n|--:|--:|--:|--:|")
    for round_ in range(2):
        start = time.perf_counter()
        llm.generate([f"round {round_} prefill. " + r.prompt for r in requests], first)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        outputs = llm.generate([f"round {round_} whole. " + r.prompt for r in requests], whole)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"| {round_ + 1} | {prefill * 1e3:.0f} | {elapsed * 1e3:.0f} | "
              f"{tokens / elapsed:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["sdpa", "prefill", "accuracy"],
                        choices=["sdpa", "prefill", "accuracy", "per-token", "burst"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 500, 1000, 2000])
    parser.add_argument("--against", help="per-token: also time the decode kernel of this git "
                                          "revision")
    args = parser.parse_args()
    print(f"{host_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    for part in args.parts:
        if part == "prefill":
            prefill_part(args.lengths)
        elif part == "per-token":
            per_token_part(args.against)
        else:
            {"sdpa": sdpa_part, "accuracy": accuracy_part, "burst": burst_part}[part]()
        print()


if __name__ == "__main__":
    main()
