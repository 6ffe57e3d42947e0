"""Weight layout for the projection matmuls: plain weights through `F.linear` (MKL re-packs the
weight on every call) against weights prepacked once for oneDNN (`loom.model.linear`), on the
bundled model's own fp32 weights. Run from the repository root:

    python benchmarks/linear_layout.py

One "chain" is every projection of one step in model order: per layer qkv, o, gate_up, down,
then lm_head (only for M <= 256: a prefill computes logits for a few rows, not all), each at M
rows, so weights stream from memory as in a real step. Layouts alternate within each round;
each figure is the best of --rounds. A second table shows the packed layout's batch hint. A
third puts loom's native kernel on the GGUF's own Q4_1/Q8_0 blocks (`--linear-backend native`,
auto on CPU float32) next to the prepacked layout, at every row count.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from loom import LLM
from loom.bench.sysinfo import hardware
from loom.model.linear import Linear


def chain_ms(linears: list[Linear], m: int, rounds: int) -> float:
    inputs = {k: torch.randn(m, k) for k in {lin.in_features for lin in linears}}

    def step() -> None:
        for lin in linears:
            lin(inputs[lin.in_features])

    return best_ms(step, rounds)


def best_ms(fn: Callable[[], None], rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,64,256,512,1024,2048")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--native-rows", default="1,2,4,8,16,24,32,64,128,512,2048")
    parser.add_argument("--native-only", action="store_true", help="only the third table")
    args = parser.parse_args()
    if args.native_only:
        with torch.inference_mode():
            native_table(args.native_rows, args.rounds)
        return
    model = LLM(dtype="float32", linear_backend="torch").engine.runner.model
    weights = [lin.weight for layer in model.layers
               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    lm_head = model.lm_head.weight

    def linears(prepack: bool, hint: int | None = None, with_head: bool = True) -> list[Linear]:
        out = [Linear(w, prepack=prepack) for w in weights + ([lm_head] if with_head else [])]
        if hint is not None:  # re-pack with another batch hint
            for lin, w in zip(out, weights + [lm_head]):
                lin.weight = torch.ops.mkldnn._reorder_linear_weight(w, hint)
        return out

    hw = hardware()
    print(f"{hw['cpu_model']}, {hw['cpus_usable']} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print("| M | F.linear ms | prepacked ms | speed-up |\n|--:|--:|--:|--:|")
    with torch.inference_mode():
        for m in map(int, args.rows.split(",")):
            plain, packed = linears(False, with_head=m <= 256), linears(True, with_head=m <= 256)
            t_plain = t_packed = float("inf")
            for _ in range(args.rounds):
                t_plain = min(t_plain, chain_ms(plain, m, 1))
                t_packed = min(t_packed, chain_ms(packed, m, 1))
            print(f"| {m} | {t_plain:.1f} | {t_packed:.1f} | {t_plain / t_packed:.2f}x |")
        print("\nBatch hint of the packed layout (ms per chain):\n")
        print("| M | hint 1 | hint 32 | hint 512 |\n|--:|--:|--:|--:|")
        for m in (8, 64, 512):
            row = [chain_ms(linears(True, hint), m, args.rounds) for hint in (1, 32, 512)]
            print(f"| {m} | " + " | ".join(f"{t:.1f}" for t in row) + " |")
        native_table(args.native_rows, args.rounds)


def native_table(rows: str, rounds: int) -> None:
    def chain(backend: str) -> list[Linear]:
        model = LLM(dtype="float32", linear_backend=backend).engine.runner.model
        return [lin for layer in model.layers
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]

    layers, packed = chain("native"), chain("onednn")
    print("\nNative kernel on the GGUF's blocks against the prepacked layout (ms per chain):\n")
    print("| M | prepacked ms | native ms | speed-up |\n|--:|--:|--:|--:|")
    for m in map(int, rows.split(",")):
        t_packed = t_native = float("inf")
        for _ in range(rounds):
            t_packed = min(t_packed, chain_ms(packed, m, 1))
            t_native = min(t_native, chain_ms(layers, m, 1))
        print(f"| {m} | {t_packed:.1f} | {t_native:.1f} | {t_packed / t_native:.2f}x |")


if __name__ == "__main__":
    main()
