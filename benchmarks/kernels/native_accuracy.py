"""The native block-quantized matmul (`--linear-backend native`) against oneDNN on the same
fp32 weights, once per kernel path: fp32 (the exact product with the GGUF's numbers; only the
summation order differs) and int8 (activations quantized per block of 32 into two int8 parts,
int16-like precision), each forced at every batch size. The engine takes the int8 path up to
`INT8_MAX_ROWS` rows and fp32 above, so a decode step runs what the int8 rows show.

Teacher-forced: dtype_accuracy.py's six passages, every position's next-token distribution.
Free-running: greedy completions of its ten prompts, up to 64 tokens, one prompt at a time
(then 1-row decode steps), token for token, and the logprobs of the tokens both chose up to
the first difference. Run from the repository root:

    python benchmarks/kernels/native_accuracy.py [--model X.gguf ...]
    python benchmarks/kernels/native_accuracy.py --reference F16.gguf --model Q4_K_M.gguf ...

The second form measures what converting a file's types at load (loom/model/requant.py) adds
to the file's own quantization error.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import host_line  # noqa: E402

# isort: split
import torch  # noqa: E402

from benchmarks.kernels.dtype_accuracy import (  # noqa: E402
    PASSAGES,
    PROMPTS,
    compare_logits,
    encode,
    passage_logits,
)
from loom import LLM, SamplingParams  # noqa: E402
from loom.model import linear, loader  # noqa: E402

PATHS = {"fp32": 0, "int8": 1 << 30}  # the linear.INT8_MAX_ROWS that forces each path


def teacher_forced(ref: LLM, test: LLM) -> dict[str, float]:
    tokenizer = ref.tokenizer
    positions = agree = 0
    kl_sum, kl_max, max_lp_diff, nll_ref, nll_test = 0.0, 0.0, 0.0, 0.0, 0.0
    for passage in PASSAGES.values():
        ids = encode(tokenizer, passage, generation=False)
        logits = [passage_logits(llm.engine.runner.model, ids, llm.engine.runner.backends.kv_dtype)
                  for llm in (ref, test)]
        r = compare_logits(*logits, ids)
        positions += r["positions"]
        agree += r["top1_agree"]
        kl_sum, kl_max = kl_sum + r["kl_sum"], max(kl_max, r["kl_max"])
        nll_ref, nll_test = nll_ref + r["nll_ref"], nll_test + r["nll_test"]
        diff = (logits[0].log_softmax(-1) - logits[1].log_softmax(-1)).abs()
        max_lp_diff = max(max_lp_diff, float(diff.max()))
    return {"positions": positions, "top1": 100 * agree / positions,
            "kl_mean": kl_sum / positions, "kl_max": kl_max, "lp_diff": max_lp_diff,
            "ppl_ref": math.exp(nll_ref / positions), "ppl_test": math.exp(nll_test / positions)}


def free_running(ref: LLM, test: LLM) -> dict[str, float]:
    params = SamplingParams(max_tokens=64, temperature=0, logprobs=0)
    same, max_lp_diff = 0, 0.0
    for prompt in PROMPTS:
        ids = encode(ref.tokenizer, prompt, generation=True)
        a, b = (llm.generate(ids, params)[0].outputs[0] for llm in (ref, test))
        same += a.token_ids == b.token_ids
        for x, y, lx, ly in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if x != y:
                break
            max_lp_diff = max(max_lp_diff, abs(lx.logprob - ly.logprob))
    return {"identical": same, "prompts": len(PROMPTS), "lp_diff": max_lp_diff}


def print_header(what: str, ref: str, test: str) -> None:
    print(f"{host_line()}; torch {torch.__version__}\n")
    print(f"| {what} | top-1 agree | mean KL | max KL | max abs logprob diff | ppl {ref} "
          f"| ppl {test} | greedy identical | max abs logprob diff, greedy tokens |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")


def print_row(name: str, ref: LLM, test: LLM) -> None:
    """Both comparisons of `test` against `ref`, as one row of print_header's table."""
    tf, fr = teacher_forced(ref, test), free_running(ref, test)
    print(f"| {name} | {tf['top1']:.2f}% of {tf['positions']} | {tf['kl_mean']:.1e} | "
          f"{tf['kl_max']:.1e} | {tf['lp_diff']:.1e} | {tf['ppl_ref']:.4f} | "
          f"{tf['ppl_test']:.4f} | {fr['identical']}/{fr['prompts']} | {fr['lp_diff']:.1e} |",
          flush=True)


def fp32_llm(model: str | None, backend: str) -> LLM:
    return LLM(model=model, dtype="float32", linear_backend=backend, kv_cache_memory="128MiB",
               kv_cache_dtype="float32")


def against_reference(reference: str, models: list[str]) -> None:
    """Each GGUF as the engine runs it (types the kernel does not read converted at load)
    and with its file's own values (oneDNN, nothing converted), against `reference` (say the
    F16 file the others were quantized from): what the conversion adds to the file's own
    quantization error."""
    ref = fp32_llm(reference, "onednn")
    print_header("model, weights", "reference", "model")
    converted = loader.CONVERTED_KINDS
    for model in models:
        name = Path(model).name
        try:
            loader.CONVERTED_KINDS = ()
            print_row(f"{name}, the file's values", ref, fp32_llm(model, "onednn"))
        finally:
            loader.CONVERTED_KINDS = converted
        print_row(f"{name}, as the engine runs it", ref, fp32_llm(model, "auto"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=[None],
                        help="GGUF files (default: the bundled model); types the kernel does "
                             "not read are converted at load (loom/model/requant.py), and the "
                             "oneDNN reference computes with each file's own values")
    parser.add_argument("--reference", default=None,
                        help="compare each --model with this one instead (e.g. the F16 GGUF "
                             "they were quantized from): its file's values and as the engine "
                             "runs it")
    args = parser.parse_args()
    if args.reference:
        return against_reference(args.reference, args.model)
    engine_rows = linear.INT8_MAX_ROWS
    for model in args.model:
        ref, native = fp32_llm(model, "onednn"), fp32_llm(model, "native")
        print(f"\nmodel: {ref.engine.model_name}")
        print_header("native path", "onednn", "native")
        try:
            for name, rows in PATHS.items():
                linear.INT8_MAX_ROWS = dict.fromkeys(engine_rows, rows)
                print_row(name, ref, native)
        finally:
            linear.INT8_MAX_ROWS = engine_rows


if __name__ == "__main__":
    with torch.inference_mode():
        main()
