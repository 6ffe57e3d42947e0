"""Single-op costs that BENCHMARKS.md's speed sections lean on, timed alone at this model's
shapes. Run from the repository root:

    python benchmarks/kernels/op_costs.py

1. Prefill attention for a 512-token chunk over 1,024 tokens of cached context (9 heads, 3 kv
   heads, dim 64): torch's SDPA with the chunk's causal mask, in fp32 and bf16, against a bare
   bf16 bmm of the same q.K scores (a lower bound on what a native kernel would pay).
2. Sampling 32 rows of a 49,152-token vocabulary: the exponential race (one random number
   per vocabulary entry) against inverse-CDF sampling (one per row), which loom uses; and
   greedy, torch's argmax against numpy's (loom.model.sampler.row_argmax).
3. One step's outputs of 32 requests (1,000-token prompts, top-5 logprobs) crossing the engine
   process's pipe at their 10th, 500th and 2,000th token: pickled and unpickled whole (the
   cumulative RequestOutput), against as what they added since the step before
   (loom.engine.output_delta).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import host_line, mean_seconds, timings  # noqa: E402

# isort: split
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from loom.engine.output_delta import DeltaDecoder, DeltaEncoder  # noqa: E402
from loom.model.attention import _chunk_mask  # noqa: E402
from loom.model.logits import row_argmax  # noqa: E402
from loom.outputs import CompletionOutput, RequestOutput, TokenLogprob  # noqa: E402


def ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Mean ms a call, after a warm-up."""
    return mean_seconds(fn, repeats) * 1e3


def prefill_attention() -> None:
    query_len, context_len, heads, kv_heads, dim = 512, 1024, 9, 3, 64
    mask = _chunk_mask(query_len, context_len, 0, None, torch.device("cpu"))
    print(f"prefill attention, {query_len} queries over {context_len} keys, one layer:")
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, heads, query_len, dim).to(dtype)
        k = torch.randn(1, kv_heads, context_len, dim).to(dtype)
        v = torch.randn(1, kv_heads, context_len, dim).to(dtype)
        sdpa = ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True))
        flops = 4 * heads * query_len * context_len * dim
        print(f"  SDPA with mask, {str(dtype).removeprefix('torch.')}: {sdpa:.2f} ms "
              f"({flops / sdpa / 1e6:.0f} GFLOP/s)")
    q = torch.randn(kv_heads, heads // kv_heads * query_len, dim).to(torch.bfloat16)
    k = torch.randn(kv_heads, context_len, dim).to(torch.bfloat16)
    print(f"  bf16 bmm of the q.K scores alone: {ms(lambda: torch.bmm(q, k.transpose(1, 2))):.2f}"
          " ms")


def sampling() -> None:
    logits = torch.randn(32, 49152)

    def exponential_race() -> torch.Tensor:
        probs = logits.softmax(-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(-1)

    def inverse_cdf() -> torch.Tensor:
        cdf = logits.softmax(-1).cumsum(-1)
        return torch.searchsorted(cdf, torch.rand(32, 1) * cdf[:, -1:], right=True)

    print("sampling 32 rows x 49,152 tokens:")
    print(f"  exponential race: {ms(exponential_race):.2f} ms")
    print(f"  inverse CDF: {ms(inverse_cdf):.2f} ms")
    print(f"  greedy, torch argmax: {ms(lambda: logits.argmax(-1), 50):.2f} ms")
    print(f"  greedy, row_argmax (numpy): {ms(lambda: row_argmax(logits), 50):.2f} ms")


def step_outputs(num_tokens: int, requests: int = 32, prompt_len: int = 1000
                 ) -> list[RequestOutput]:
    """Distinct objects everywhere, as the engine's are: pickle sends a shared one once."""
    def logprobs() -> list[TokenLogprob]:
        return [TokenLogprob(7, -0.5, [(i, -0.1 * i) for i in range(5)])
                for _ in range(num_tokens)]

    return [RequestOutput(f"r{i}", "word " * prompt_len, list(range(prompt_len)),
                          [CompletionOutput(0, "word " * num_tokens, list(range(num_tokens)),
                                            logprobs=logprobs())], False)
            for i in range(requests)]


def as_deltas_s(before: list[RequestOutput], now: list[RequestOutput]) -> float:
    """Seconds to encode, pickle, unpickle and decode `now`, each request's previous step
    (`before`) sent first, untimed."""
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    for output in before:
        decoder.decode(encoder.encode(output))
    start = time.perf_counter()
    for delta in pickle.loads(pickle.dumps([encoder.encode(output) for output in now])):
        decoder.decode(delta)
    return time.perf_counter() - start


def pipe_outputs() -> None:
    print("one step's outputs of 32 requests (1,000-token prompts, top-5 logprobs) over the "
          "pipe, pickle + unpickle (best of 3):")
    for num_tokens in (10, 500, 2000):
        before, now = step_outputs(num_tokens - 1), step_outputs(num_tokens)
        whole = min(timings(lambda now=now: pickle.loads(pickle.dumps(now)), 3)) * 1e3
        deltas = min(as_deltas_s(before, now) for _ in range(3)) * 1e3
        print(f"  at token {num_tokens}: whole {whole:.2f} ms, as deltas {deltas:.2f} ms")


PARTS = {"prefill-attention": prefill_attention, "sampling": sampling, "pipe": pipe_outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    args = parser.parse_args()
    print(host_line())
    for part in args.parts:
        PARTS[part]()


if __name__ == "__main__":
    main()
