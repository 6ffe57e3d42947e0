"""The native block-quantized matmul (`--linear-backend native`) against oneDNN on the same
fp32 weights: both compute with the GGUF's own numbers, so only the summation order differs,
and this measures how much that shows.

Teacher-forced: dtype_accuracy.py's six passages, every position's next-token distribution,
every projection on the native kernel as the engine runs it (prefill-sized batches).
Free-running: greedy completions of its ten prompts, up to 64 tokens, one prompt at a time
(then 1-row decode steps), token for token. Run from the repository root:

    python benchmarks/native_accuracy.py
"""

from __future__ import annotations

import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from dtype_accuracy import PASSAGES, PROMPTS, compare_logits, encode, passage_logits  # noqa: E402

from loom import LLM, SamplingParams  # noqa: E402


def main() -> None:
    llms = {b: LLM(dtype="float32", linear_backend=b, kv_cache_memory="128MiB")
            for b in ("onednn", "native")}
    tokenizer = llms["onednn"].tokenizer
    positions = agree = 0
    kl_sum, kl_max, max_lp_diff, nll = 0.0, 0.0, 0.0, {"onednn": 0.0, "native": 0.0}
    for passage in PASSAGES.values():
        ids = encode(tokenizer, passage, generation=False)
        logits = {b: passage_logits(llm.engine.runner.model, ids) for b, llm in llms.items()}
        r = compare_logits(logits["onednn"], logits["native"], ids)
        positions += r["positions"]
        agree += r["top1_agree"]
        kl_sum, kl_max = kl_sum + r["kl_sum"], max(kl_max, r["kl_max"])
        nll["onednn"] += r["nll_ref"]
        nll["native"] += r["nll_test"]
        diff = (logits["onednn"].log_softmax(-1) - logits["native"].log_softmax(-1)).abs()
        max_lp_diff = max(max_lp_diff, float(diff.max()))
    print(f"Teacher-forced, {positions} positions:")
    print(f"- top-1 agreement {100 * agree / positions:.2f}%, mean KL {kl_sum / positions:.2e}, "
          f"max KL {kl_max:.2e}, max |logprob difference| {max_lp_diff:.2e}")
    print(f"- perplexity onednn {math.exp(nll['onednn'] / positions):.4f}, "
          f"native {math.exp(nll['native'] / positions):.4f}")
    params = SamplingParams(max_tokens=64, temperature=0)
    same = 0
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt, generation=True)
        outs = [llm.generate(ids, params)[0].outputs[0].token_ids for llm in llms.values()]
        same += outs[0] == outs[1]
    print(f"Free-running greedy, one prompt at a time: {same}/{len(PROMPTS)} completions "
          "identical token for token")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
