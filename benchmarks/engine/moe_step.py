"""Where a mixture-of-experts decode step's time goes: the MoE kernel against the bytes it must
read, and the MoE layers' share of a whole step. Run from the repository root:

    python benchmarks/engine/moe_step.py --gguf olmoe-Q4_K_M.gguf --tokens 1,8 --users 8

1. One layer's `moe_experts` (loom.model.moe.MoeBlock on the file's first `--layers` layers) at
   each token count and each `--int8-rows` limit (an expert of at most that many rows takes the
   int8 path, else the fp32 one; "engine": the engine's own limit for this kernel build): ms a
   layer, the experts the tokens touch (random activations, the file's routers) and the rate at
   which it reads those experts' panels (the bytes a step cannot avoid: each touched expert
   once).
2. The offline engine with `--users` greedy requests decoding together: decode steps' wall time
   and the part of it inside the MoE layers (the difference of two runs that share their
   prefill, so prefill cancels out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import host_line  # noqa: E402

# isort: split
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from loom import LLM, SamplingParams  # noqa: E402
from loom.model import moe  # noqa: E402
from loom.model.arch import ModelArch  # noqa: E402
from loom.model.gguf_file import read_gguf  # noqa: E402
from loom.model.kernels import block_quant_linear_ops  # noqa: E402
from loom.model.linear import INT8_MAX_ROWS, INT8_MAX_ROWS_VNNI  # noqa: E402
from loom.model.model_files import read_arch  # noqa: E402


@dataclass(frozen=True)
class KernelTiming:
    tokens: int
    int8_rows: int  # the 4-bit codes' limit
    ms_per_layer: float
    experts_touched: float  # mean over the draws, per layer
    read_gb_s: float  # the touched experts' panel bytes / time


def kernel_timings(gguf: str, arch: ModelArch, layers: int, token_counts: list[int],
                   int8_limits: list[dict[int, int]], draws: int = 8) -> list[KernelTiming]:
    tensors = {t.name: t for t in read_gguf(Path(gguf)).tensors}
    ops = block_quant_linear_ops()
    routing = moe.Routing.from_arch(arch)
    blocks = [moe.moe_from_gguf(tensors, layer, routing, ops) for layer in range(layers)]
    assert all(b.native for b in blocks), "the experts are off the native MoE kernel"
    expert_bytes = statistics.mean(b._panels.gate_up[0].numel() + b._panels.down[0].numel()
                                   for b in blocks)
    generator = torch.Generator().manual_seed(0)
    timings = []
    for tokens, int8_rows in ((t, r) for t in token_counts for r in int8_limits):
        for b in blocks:
            b.int8_max_rows = int8_rows
        xs = [torch.randn(tokens, arch.hidden_size, generator=generator) for _ in range(draws)]
        for block in blocks:  # warm-up
            block(xs[0])
        times, touched = [], []
        for x in xs:
            start = time.perf_counter()
            for block in blocks:
                block(x)
            times.append((time.perf_counter() - start) / layers)
            touched += [moe.route(F.linear(x, b.router), routing)[0].unique().numel()
                        for b in blocks]
        ms, experts = statistics.median(times), statistics.mean(touched)
        timings.append(KernelTiming(tokens, int8_rows[4], 1e3 * ms, experts,
                                    experts * expert_bytes / ms / 1e9))
    return timings


def engine_share(gguf: str, users: int, batched_matmul: str, short: int = 8, long: int = 40
                 ) -> tuple[float, float]:
    """(ms a decode step, ms of it in the MoE layers) with `users` requests decoding."""
    spent = [0.0]
    call = moe.MoeBlock.__call__

    def timed(self: moe.MoeBlock, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = call(self, x)
        spent[0] += time.perf_counter() - start
        return out

    moe.MoeBlock.__call__ = timed
    llm = LLM(model=gguf, max_num_seqs=users, kv_cache_memory="512MiB", max_model_len=512,
              batched_matmul=batched_matmul)
    prompts = [list(range(1000 + 50 * i, 1032 + 50 * i)) for i in range(users)]

    def run(tokens: int) -> tuple[float, float]:
        spent[0] = 0.0
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0,
                                             ignore_eos=True))
        return time.perf_counter() - start, spent[0]

    run(short)  # warm-up
    (wall_short, moe_short), (wall_long, moe_long) = run(short), run(long)
    steps = long - short
    return 1e3 * (wall_long - wall_short) / steps, 1e3 * (moe_long - moe_short) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", required=True, help="a GGUF with block-quantized experts")
    parser.add_argument("--layers", type=int, default=4, help="layers timed in part 1")
    parser.add_argument("--tokens", default="1,8", help="token counts for part 1")
    parser.add_argument("--int8-rows", default="engine",
                        help="part 1's int8 row limits, comma-separated (engine: the engine's)")
    parser.add_argument("--users", type=int, default=8, help="part 2's requests (0: skip)")
    parser.add_argument("--batched-matmul", default="auto,native",
                        help="part 2's settings of the engine's batched_matmul, one run each")
    args = parser.parse_args()
    print(host_line())
    arch = read_arch(Path(args.gguf))
    engine_rows = INT8_MAX_ROWS_VNNI if block_quant_linear_ops().vnni() else INT8_MAX_ROWS
    limits = [dict(engine_rows) if n == "engine" else {4: int(n), 8: int(n)}
              for n in args.int8_rows.split(",")]
    for t in kernel_timings(args.gguf, arch, args.layers,
                            [int(n) for n in args.tokens.split(",")], limits):
        print(f"moe_experts, {t.tokens} tokens, int8 to {t.int8_rows} rows: "
              f"{t.ms_per_layer:.2f} ms a layer, "
              f"{t.experts_touched:.1f} of {arch.num_experts} experts, "
              f"{t.read_gb_s:.1f} GB/s of their panels")
    for batched_matmul in args.batched_matmul.split(",") if args.users else []:
        step_ms, moe_ms = engine_share(args.gguf, args.users, batched_matmul)
        print(f"engine, {args.users} users decoding, batched_matmul {batched_matmul}: "
              f"{step_ms:.1f} ms a step, "
              f"{moe_ms:.1f} ms ({moe_ms / step_ms:.0%}) in the MoE layers "
              f"({moe_ms / arch.num_layers:.2f} ms a layer)")


if __name__ == "__main__":
    main()
