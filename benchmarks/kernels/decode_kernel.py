"""Decode attention alone, one layer: the native kernel against the torch path (gather each
request's blocks, pad, SDPA per length group), on random caches with SmolLM2's shape (9 query
heads, 3 kv heads, head_dim 64, block 16) and scattered blocks; fp32 queries over an fp32 and
an fp16 cache, bf16 over bf16. With --against REV, the
kernel's source at git revision REV is compiled too and timed on the same inputs, in the same
run, for a before/after ratio: both kernels called straight (the "native" column goes through
`paged_attention`, whose output allocation and copy made an A/A run of one source read
0.70-0.92x when the old kernel alone was called straight), taking turns, first and second in
alternate rounds. Run from the repository root:

    python benchmarks/kernels/decode_kernel.py
    python benchmarks/kernels/decode_kernel.py --against 1207948
    python benchmarks/kernels/decode_kernel.py --contexts 20-60   # short: per-request costs
    python benchmarks/kernels/decode_kernel.py --decodes 1 2 4 --contexts 4000-4000  # one user
    python benchmarks/kernels/decode_kernel.py --layers 30   # each layer its own caches, as in
                                                   # the model: read from memory, not cache
    python benchmarks/kernels/decode_kernel.py --layers 30 --v-layouts   # V stored kv head
                              # before position (new_kv_cache) against position before kv head

With --v-layouts, the same values are also copied into a V cache stored position before kv
head (each position's heads side by side, the layout before 965516a), and the kernel, called
straight, is timed over both in turns (`alternating`); the outputs are compared bit for bit.
"""

from __future__ import annotations

import argparse
import functools
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import alternating, host_line, mean_seconds  # noqa: E402

# isort: split
import torch  # noqa: E402
from torch.utils.cpp_extension import load  # noqa: E402

from loom.model.attention import AttentionMetadata, new_kv_cache, paged_attention  # noqa: E402
from loom.model.kernels import paged_attention_ops  # noqa: E402
from loom.model.runner import ModelRunner  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def over_layers(call: Callable[[torch.Tensor, torch.Tensor], object],
                layers: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """ms per layer of call(k_cache, v_cache) run over every layer's caches in turn (the mean
    of 20 passes after one warm-up)."""
    return mean_seconds(lambda: [call(k, v) for k, v in layers], 20) * 1e3 / len(layers)


def attend(q: torch.Tensor, unused: torch.Tensor, meta: AttentionMetadata,
           k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    return paged_attention(q, unused, unused, k_cache, v_cache, meta)


def csrc_at(rev: str, source: str) -> Path:
    """A folder holding the kernel source `source` and the csrc headers as they were at git
    revision `rev`, to compile side by side with today's."""
    directory = Path(tempfile.mkdtemp())
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:src/loom/model/csrc"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if name == source or name.endswith(".h"):
            (directory / name).write_text(subprocess.run(
                ["git", "show", f"{rev}:src/loom/model/csrc/{name}"], check=True,
                capture_output=True, text=True).stdout)
    return directory


def kernel_at(rev: str) -> ModuleType:
    """The decode-attention extension as it was at git revision `rev`."""
    path = csrc_at(rev, "paged_attention.cpp") / "paged_attention.cpp"
    return load(name=f"loom_paged_attention_{rev}", sources=[str(path)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                extra_ldflags=["-fopenmp"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="also time the kernel of this git revision")
    parser.add_argument("--contexts", default="50-1100",
                        help="context lengths drawn uniformly from LO-HI (default 50-1100)")
    parser.add_argument("--decodes", type=int, nargs="+", default=[8, 32, 64],
                        help="requests a call, one table row each (default 8 32 64)")
    parser.add_argument("--layers", type=int, default=1,
                        help="layers of caches the timed calls cycle through (default 1: the "
                             "caches stay in the CPU's caches; the model's 30 do not)")
    parser.add_argument("--v-layouts", action="store_true",
                        help="also time the kernel over V stored position before kv head")
    args = parser.parse_args()
    low, high = (int(x) for x in args.contexts.split("-"))
    old = kernel_at(args.against) if args.against else None
    print(host_line() + "\n")
    extra = (f" | now, called straight | {args.against} ms/layer | {args.against} / now"
             if old else "")
    if args.v_layouts:
        extra += (" | head-major V ms/layer | position-major V ms/layer | position-major / "
                  "head-major | outputs equal")
    print("| dtype | KV cache | decodes | mean context | torch path ms/layer | native ms/layer "
          f"| native GFLOP/s | speed-up{extra} |\n|---|---|--:|--:|--:|--:|--:|--:|"
          + ("--:|--:|--:|" if old else "") + ("--:|--:|--:|:-:|" if args.v_layouts else ""))
    runner = ModelRunner.__new__(ModelRunner)  # only its metadata builders
    runner.block_size, runner.device = BLOCK, torch.device("cpu")
    for dtype, cache_dtype in ((torch.float32, torch.float32), (torch.float32, torch.float16),
                               (torch.bfloat16, torch.bfloat16)):
        for n in args.decodes:
            rng = random.Random(n)
            lens = [rng.randint(low, high) for _ in range(n)]
            num_blocks = sum(-(-length // BLOCK) for length in lens) + 1
            layers = [new_kv_cache(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, cache_dtype,
                                   torch.device("cpu")) for _ in range(args.layers)]
            for cache in (c for layer in layers for c in layer):
                cache.copy_(torch.randn(cache.shape))
            free = list(range(num_blocks - 1))
            rng.shuffle(free)
            tables = []
            for length in lens:
                count = -(-length // BLOCK)
                tables.append(free[:count])
                free = free[count:]
            order = sorted(range(n), key=lambda i: lens[i])  # the runner sorts by length
            tables, lens = [tables[i] for i in order], [lens[i] for i in order]
            q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
            unused = torch.zeros(n, KV_HEADS, HEAD_DIM, dtype=dtype)
            slots = (torch.zeros(0, dtype=torch.long),) * 2  # nothing is written
            native = AttentionMetadata(slots, [], [], runner._paged_decodes(tables, lens))
            torch_path = AttentionMetadata(slots, runner._decode_groups(tables, lens), [])
            torch_ms = over_layers(functools.partial(attend, q, unused, torch_path), layers)
            native_ms = over_layers(functools.partial(attend, q, unused, native), layers)
            old_runs = old is not None and old.supported(HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype,
                                                         cache_dtype)  # not: before fp16 caches
            if old_runs:  # both kernels called the same way: straight, no wrapper
                now_ms, old_ms = alternating([functools.partial(
                    over_layers, lambda k, v, q=q, pd=native.paged_decodes, m=m:
                    m.paged_decode_attention(q, k, v, pd.block_tables, pd.context_lens,
                                             HEAD_DIM ** -0.5), layers)
                    for m in (paged_attention_ops(), old)])
            times = [torch_ms, native_ms]
            flops = 4 * sum(lens) * HEADS * HEAD_DIM
            row = (f"| {str(dtype).removeprefix('torch.')} | "
                   f"{str(cache_dtype).removeprefix('torch.')} | {n} | {sum(lens) // n} | "
                   f"{times[0]:.3f} | {times[1]:.3f} | {flops / times[1] / 1e6:.0f} | "
                   f"{times[0] / times[1]:.1f}x |")
            if old_runs:
                row += f" {now_ms:.3f} | {old_ms:.3f} | {old_ms / now_ms:.2f}x |"
            elif old is not None:
                row += " - | - | - |"
            if args.v_layouts:
                row += v_layouts_row(q, native.paged_decodes, layers)
            print(row, flush=True)


def v_layouts_row(q: torch.Tensor, decodes, layers: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> str:
    """The kernel, called straight, over the layers' caches as new_kv_cache lays them out and
    over copies of their V stored position before kv head, in turns: the row's extra cells."""
    ops = paged_attention_ops()
    position_major = [(k, v.contiguous()) for k, v in layers]

    def call(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ops.paged_decode_attention(q, k, v, decodes.block_tables, decodes.context_lens,
                                          HEAD_DIM ** -0.5)

    equal = all(torch.equal(call(*a), call(*b)) for a, b in zip(layers, position_major))
    head_ms, position_ms = alternating([functools.partial(over_layers, call, caches)
                                        for caches in (layers, position_major)])
    return (f" {head_ms:.3f} | {position_ms:.3f} | {position_ms / head_ms:.2f}x | "
            f"{'yes' if equal else 'no'} |")


if __name__ == "__main__":
    main()
