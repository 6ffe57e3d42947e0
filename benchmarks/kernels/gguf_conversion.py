"""How long loading takes to convert a GGUF's blocks for the native matmul (loom/model/requant.py),
per GGUF type: milliseconds and nanoseconds a weight, for each file given, one conversion of
every 2-D tensor of a converted type (what `loom serve --model FILE` does once at start-up).

Only what older checkouts have too is used, so a before/after is this script run from each
tree (`PYTHONPATH=<tree>/src`). Run from the repository root:

    python benchmarks/kernels/gguf_conversion.py FILE.gguf [FILE.gguf ...]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.harness import host_line  # noqa: E402
from loom.model.gguf_file import read_gguf  # noqa: E402
from loom.model.requant import CONVERTED_KINDS, native_blocks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    print(f"{host_line()}\n")
    print("| file | type | weights (M) | ms | ns a weight |\n|---|---|--:|--:|--:|")
    for path in args.files:
        seconds: dict[str, float] = collections.defaultdict(float)
        weights: collections.Counter[str] = collections.Counter()
        for tensor in read_gguf(path).tensors:
            if tensor.kind not in CONVERTED_KINDS or len(tensor.shape) != 2:
                continue
            start = time.perf_counter()
            native_blocks(tensor.kind, tensor.data, tuple(tensor.shape))
            seconds[tensor.kind] += time.perf_counter() - start
            weights[tensor.kind] += tensor.shape[0] * tensor.shape[1]
        for kind, spent in seconds.items():
            print(f"| {path.name} | {kind} | {weights[kind] / 1e6:.1f} | {spent * 1e3:.0f} | "
                  f"{spent / weights[kind] * 1e9:.2f} |")
        print(f"| {path.name} | all | {sum(weights.values()) / 1e6:.1f} | "
              f"{sum(seconds.values()) * 1e3:.0f} | |")


if __name__ == "__main__":
    main()
