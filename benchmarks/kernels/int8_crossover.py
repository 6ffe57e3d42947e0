"""Where the native matmul's int8 path stops beating its fp32 one, per code width: the
projections of a model's layers (random codes of each kind: the time does not depend on them)
with each path forced, at each row count, the paths taking turns in every round, on this
checkout's build of the kernel (whether it has VNNI is printed). The engine's row limits
(model/linear.py INT8_MAX_ROWS, INT8_MAX_ROWS_VNNI) sit where fp32 / int8 falls below 1.
Run from the repository root:

    python benchmarks/kernels/int8_crossover.py --rows 1,8,16,32,64,128,256,512

--shape qwen3-8b times one layer of that shape (hidden 4096, ffn 12288, 32/8 heads of 128)
instead of the bundled model's 30 (hidden 576, ffn 1536, 9/3 heads of 64).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import host_line, timings  # noqa: E402

# isort: split
import torch  # noqa: E402

from loom.model.kernels import block_quant_linear_ops  # noqa: E402
from loom.model.linear import to_panels  # noqa: E402
from loom.model.weights import BlockQuantWeight  # noqa: E402

PATHS = {"int8": 1 << 30, "fp32": 0}  # the kernel's int8_rows argument that forces each path
CODES = {"Q4_1": (0, 16), "Q8_0": (-128, 128)}  # one kind per code width


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    qkv: int  # output channels of the fused q, k, v projection
    layers: int


SHAPES = {"smollm2-135m": Shape(576, 1536, 960, 30), "qwen3-8b": Shape(4096, 12288, 6144, 1)}


def random_panels(out_features: int, in_features: int, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    low, high = CODES[kind]
    blocks = (out_features, in_features // 32)
    bq = BlockQuantWeight.from_codes(
        codes=torch.randint(low, high, (out_features, in_features), generator=gen,
                            dtype=torch.int8),
        scale=(torch.rand(blocks, generator=gen) * 0.02 + 0.001).half().float(),
        offset=(-torch.rand(blocks, generator=gen) * 0.1).half().float() if kind == "Q4_1"
        else torch.zeros(blocks), kind=kind)
    return to_panels(bq, block_quant_linear_ops())


def layer_panels(shape: Shape, kind: str) -> list[torch.Tensor]:
    """Every layer's qkv, o, gate_up and down panels, in model order."""
    h, f = shape.hidden, shape.ffn
    sizes = [(shape.qkv, h), (h, h), (2 * f, h), (h, f)]
    return [random_panels(n, k, kind, seed=4 * layer + i)
            for layer in range(shape.layers) for i, (n, k) in enumerate(sizes)]


def chain_ms(panels: list[torch.Tensor], rows: int, int8_rows: int, rounds: int) -> float:
    ops = block_quant_linear_ops()
    inputs = {k: torch.randn(rows, k) for k in {p.shape[1] * 32 for p in panels}}

    def chain() -> None:
        for p in panels:
            ops.block_quant_linear(inputs[p.shape[1] * 32], p, None, int8_rows)

    return min(timings(chain, rounds)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    parser.add_argument("--rows", default="1,4,8,12,16,20,24,32,48,64,128,512")
    parser.add_argument("--kinds", default=",".join(CODES))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ops = block_quant_linear_ops()
    if ops is None:
        raise SystemExit("the native kernel did not build")
    print(host_line())
    print(f"kernel built {'with' if ops.vnni() else 'without'} VNNI; shape {args.shape}, "
          f"{torch.get_num_threads()} threads; ms per chain of every layer's projections, best "
          f"of {args.rounds} rounds\n")
    for kind in args.kinds.split(","):
        panels = layer_panels(SHAPES[args.shape], kind)
        print(f"{kind}:\n\n| rows | int8 ms | fp32 ms | fp32 / int8 |\n|--:|--:|--:|--:|")
        for rows in map(int, args.rows.split(",")):
            best = dict.fromkeys(PATHS, float("inf"))
            for _ in range(args.rounds):  # the paths alternate within each round
                for name, int8_rows in PATHS.items():
                    best[name] = min(best[name], chain_ms(panels, rows, int8_rows, 1))
            print(f"| {rows} | {best['int8']:.2f} | {best['fp32']:.2f} | "
                  f"{best['fp32'] / best['int8']:.2f} |", flush=True)
        print()
        del panels


if __name__ == "__main__":
    with torch.inference_mode():
        main()
