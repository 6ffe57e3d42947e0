"""An fp16 KV cache (what `--kv-cache-dtype auto` picks for float32 on CPU) against an fp32 one,
on the same model and the same native matmuls: dtype_accuracy.py's six passages teacher-forced
(every position's next-token distribution, prefilled through the paged cache), and its ten
prompts' greedy completions, up to 64 tokens, token for token through the engine (prefill,
then decode steps that read every earlier key and value back from the cache). Run from the
repository root:

    python benchmarks/kernels/kv_dtype_accuracy.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)

# isort: split
import torch  # noqa: E402

from benchmarks.kernels.native_accuracy import print_header, print_row  # noqa: E402
from loom import LLM  # noqa: E402


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    ref, test = (LLM(dtype="float32", kv_cache_memory="128MiB", kv_cache_dtype=kv)
                 for kv in ("float32", "float16"))
    print_header("KV cache", "fp32 KV", "fp16 KV")
    print_row("float16", ref, test)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
