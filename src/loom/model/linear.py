"""Linear layers, y = x W^T + b, with W kept in the layout its matmul library wants.

On CPU, torch's `F.linear` hands an fp32 matmul to MKL, which re-packs the weight into its
own panel layout on every call. At the narrow batches of decode steps (1-64 rows) that
re-pack costs about as much as the arithmetic. oneDNN can take the weight packed once, at
load time, as vLLM's CPU backend and inductor's freezing pass do (how much that buys at each
batch size: `benchmarks/kernels/linear_layout.py`).

When the weight came from a GGUF in a block-quantized format, every batch goes to loom's native
kernel instead (csrc/block_quant_linear.cpp), on the file's own codes at the file's own size
(4-bit codes two to a byte, fp16 scales; Q4_K's 6-bit scales and mins as they are), re-laid out
in panels of 8 output channels; no fp32 weight is kept. Up to INT8_MAX_ROWS rows (decode steps)
it quantizes the activations per block of 32 into two int8 parts (int16 precision; one part, as
llama.cpp does, changed this model's greedy tokens) and streams the weight through integer dot
products; above that (prefill) it decodes each panel to fp32 once and computes the fp32 product
with the file's weights. `benchmarks/kernels/linear_layout.py --native-only` times both paths
and `benchmarks/kernels/native_accuracy.py` measures what the int8 one costs in accuracy.

On a CPU with native bf16 instructions (avx512_bf16, AMX) a layer can also keep a bf16 copy of
the weight for calls of more than a few rows (BF16_ABOVE_ROWS, BF16_ABOVE_ROWS_AMX): oneDNN's
bf16 matmul outruns the native kernel there, while its int8 path stays the fastest below, at
a quarter of the bytes (`loom.model.backends`, `batched_matmul`). x is rounded to bf16 on the
way in and the product on the way out, as a bfloat16 model's matmuls are; the rest of the
model stays float32. loom's own ops run it, on loom's kernel pool (a call from Python wakes
torch's sleeping OpenMP threads every time): on a CPU with AMX, a tile kernel of loom's own on
the copy laid out in AMX tiles (csrc/fused_ops.cpp `amx_bf16_linear`, `amx_tiles`); elsewhere
oneDNN's matmul on oneDNN-packed slices of the output columns, one per thread
(`bf16_linear`, `bf16_slices`), as an unpacked weight is re-laid out on every call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from loom.model.kernels import fused_ops
from loom.model.weights import BLOCK_LAYOUT, FOUR_BIT_KINDS, BlockQuantWeight

# oneDNN picks its packed layout for a typical batch; one layout serves every batch size. A
# 512-row hint was as fast as small ones at decode sizes and, unlike them, does not lose to
# F.linear on prefill-sized batches (benchmarks/kernels/linear_layout.py).
_PACK_BATCH_HINT = 512

# Output channels per panel of the native kernel's weight layout; the kernel's fp32 path takes
# two panels at a time, so a layer runs on it only with whole pairs.
PANEL_CHANNELS = 8

# Rows up to which the native kernel computes with int8 activations (decode steps), by the
# weight's code width; above it, in fp32 (prefill), where its register tile beats the integer
# one. 8-bit codes cross over later: their integer product is one int16 multiply per code
# against two byte products for 4-bit codes (measured over the bundled model's Q4_1 layers and
# Q8_0 lm_head; benchmarks/kernels/linear_layout.py times both paths). Both paths read the same
# panels, so the choice is per call. Not batch-invariant: a decode row in a step of more rows takes
# the fp32 path and can round differently (--batch-invariant takes int8 for every call:
# model/batch_invariant.py).
INT8_MAX_ROWS = {4: 12, 8: 20}
# With AVX512-VNNI (one vpdpbusd / vpdpwssd per code group and row, int32 sums) the int8 path
# beat the fp32 tile at every row count timed, 1 to 512, for both code widths (the bundled
# model's layers, benchmarks/kernels/int8_crossover.py): up to 512 rows it is the one path.
# Its two-part activations keep fp32's answers (BENCHMARKS.md, "Quality").
INT8_MAX_ROWS_VNNI = {4: 512, 8: 512}

# Rows above which a layer with bf16 copies sends a call to them (`Linear`'s bf16_above_rows,
# chosen by loom.model.backends): where the bf16 matmul overtook the int8 path over the chain
# of the model's matmuls. On AVX-512 bf16 without AMX (oneDNN's packed slices on loom's pool)
# the whole decode step measured faster on the copies from 2 rows, even with their larger
# stream of weights (a Zen 5 EPYC); on AMX, with loom's tile kernel, whose cost stays near the
# weights' stream up to tens of rows, from 4 (docs/benchmark-log.md, "The AMX tile kernel").
# One row stays on the int8 path: a tie there, and a third of the bytes for a home server's one
# user.
BF16_ABOVE_ROWS = 1
BF16_ABOVE_ROWS_AMX = 3


@dataclass(frozen=True)
class MatmulRows:
    """Which path a native-kernel call takes by its row count: calls of more rows than
    bf16_above go to bf16 copies (None: no copies); of up to int8_max[code bits], the int8
    path; others, the fp32 one."""
    bf16_above: int | None = None
    int8_max: Mapping[int, int] = field(default_factory=lambda: dict(INT8_MAX_ROWS))


def onednn_prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacking is used for CPU float32, the case it was measured on. bf16 CPU matmuls
    already go through oneDNN (unpacked); whether packing pays there is not measured."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def to_panels(bq: BlockQuantWeight, block_quant_ops: ModuleType) -> torch.Tensor:
    """The native kernel's layout of a [N, K] block-quantized weight (uint8 [N/8, K/32,
    record]; see csrc/block_quant_linear.cpp), made by the kernel's own module in one pass
    over the file's blocks."""
    header, _ = BLOCK_LAYOUT[bq.kind]
    return block_quant_ops.panels_from_blocks(bq.blocks.contiguous(), header, bq.kind == "Q4_0")


def bf16_slices(weight: torch.Tensor, count: int) -> list[torch.Tensor]:
    """A bf16 [N, K] weight as `count` slices of its output channels for fused_ops'
    bf16_linear (one per thread; the last may be narrower), edges on multiples of 64 channels
    (oneDNN's bf16 register blocks), each packed by oneDNN where it has bf16 kernels: a packed
    slice's matmul skips the re-layout of the weight that every unpacked call does."""
    step = -(-weight.shape[0] // max(1, count))
    step = -(-step // 64) * 64
    slices = [weight[start:start + step].contiguous() for start in range(0, weight.shape[0], step)]
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return [torch.ops.mkldnn._reorder_linear_weight(s, _PACK_BATCH_HINT) for s in slices]
    return slices


# Output channels per AMX block and inputs per tile step (csrc/fused_ops.cpp amx_bf16_linear).
AMX_BLOCK = 32


def amx_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] weight (N, K multiples of AMX_BLOCK) in amx_bf16_linear's layout,
    [N/32, K/32, 2, 16, 16, 2]: per block of 32 output channels and step of 32 inputs, two B
    tiles (channels 0-15, 16-31) of 16 input pairs x 16 channels x the pair."""
    n, k = weight.shape
    return (weight.reshape(n // AMX_BLOCK, 2, 16, k // AMX_BLOCK, 16, 2)
            .permute(0, 3, 1, 4, 2, 5).contiguous())


def from_amx_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """amx_tiles' inverse: the [N, K] weight."""
    blocks, steps = tiles.shape[:2]
    return tiles.permute(0, 2, 4, 1, 3, 5).reshape(blocks * AMX_BLOCK, steps * AMX_BLOCK)


def amx_kernel_runs() -> bool:
    """Whether bf16 copies are laid out for amx_bf16_linear here: loom's kernels built with the
    AMX instructions and Linux granting this process the tile state; a CPU with AMX is not
    enough (without the grant the copies are oneDNN's slices, which cross over later)."""
    ops = fused_ops()
    return ops is not None and ops.amx_available()


def amx_fits(weight_shape: torch.Size | tuple[int, int]) -> bool:
    """Whether amx_bf16_linear takes a weight of this shape: whole blocks both ways."""
    return all(size % AMX_BLOCK == 0 for size in weight_shape)


BlockQuantParts = BlockQuantWeight | Sequence[BlockQuantWeight]


def _parts(block_quant: BlockQuantParts | None) -> list[BlockQuantWeight]:
    if block_quant is None:
        return []
    return [block_quant] if isinstance(block_quant, BlockQuantWeight) else list(block_quant)


class Linear:
    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                 prepack: bool = False, block_quant: BlockQuantParts | None = None,
                 block_quant_ops: ModuleType | None = None,
                 bf16_above_rows: int | None = None,
                 int8_max_rows: Mapping[int, int] = INT8_MAX_ROWS) -> None:
        """block_quant (with the compiled block_quant_ops): the same weight in the GGUF's
        format, or its rows as parts stacked in order, each in its own kind (a fused qkv of
        Q4_K q, k and Q6_K v: BlockQuantWeight.runs); when `uses_panels` says so, every matmul
        uses it and `weight` is not kept (it may then be None). bf16_above_rows: calls of more
        rows than this run in bf16 on a copy of that weight instead (module docstring);
        int8_max_rows: calls of up to this many rows (by code width) take the kernel's int8
        path, part by part."""
        self.bias = bias
        # the kernel's panels: one tensor, or one per part (a tuple) for parts of several kinds
        self.panels: torch.Tensor | tuple[torch.Tensor, ...] | None = None
        self.batched_slices: list[torch.Tensor] | None = None  # oneDNN's, or:
        self.batched_tiles: torch.Tensor | None = None  # the AMX kernel's
        if self.uses_panels(block_quant, block_quant_ops):
            parts = _parts(block_quant)
            self.out_features = sum(p.shape[0] for p in parts)
            self.in_features = parts[0].shape[1]
            self._panel_parts = [to_panels(p, block_quant_ops) for p in parts]
            self.panels = (self._panel_parts[0] if len(parts) == 1
                           else tuple(self._panel_parts))
            self._block_quant_ops = block_quant_ops
            self._int8_max_rows = [int8_max_rows[4 if p.kind in FOUR_BIT_KINDS else 8]
                                   for p in parts]
            self.weight, self.prepacked = None, False
            if bf16_above_rows is not None:
                self._bf16_above_rows = bf16_above_rows
                self._bf16_ops = fused_ops()
                if self._bf16_ops is None:
                    raise RuntimeError("bf16 matmuls need loom's compiled bf16_linear "
                                       "(fused_ops.cpp)")
                copy = torch.cat([p.dequantize() for p in parts]).to(torch.bfloat16)
                if amx_kernel_runs() and amx_fits(copy.shape):
                    self.batched_tiles = amx_tiles(copy)
                else:
                    self.batched_slices = bf16_slices(copy, torch.get_num_threads())
            return
        if weight is None:
            raise ValueError("a Linear needs its fp32 weight unless it runs on panels")
        self.out_features, self.in_features = weight.shape
        self.prepacked = prepack
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
                       if prepack else weight)

    @staticmethod
    def uses_panels(block_quant: BlockQuantParts | None,
                    block_quant_ops: ModuleType | None) -> bool:
        """Whether the native kernel takes this weight: compiled, and whole pairs of panels
        in every part."""
        parts = _parts(block_quant)
        return (bool(parts) and block_quant_ops is not None
                and all(p.shape[0] % (2 * PANEL_CHANNELS) == 0 for p in parts))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            flat = x.dim() == 2  # the model's [tokens, features]: no reshape ops around it
            rows = x if flat else x.reshape(-1, self.in_features)
            if self.has_bf16_copy and rows.shape[0] > self._bf16_above_rows:
                out = (self._bf16_ops.amx_bf16_linear(rows.contiguous(), self.batched_tiles,
                                                      self.bias)
                       if self.batched_tiles is not None else
                       self._bf16_ops.bf16_linear(rows.contiguous(), self.batched_slices,
                                                  self.bias))
            else:
                out = self._block_quant_ops.block_quant_linear_parts(
                    rows, self._panel_parts, self.bias, self._int8_max_rows)
            return out if flat else out.view(*x.shape[:-1], self.out_features)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def has_bf16_copy(self) -> bool:
        return self.batched_slices is not None or self.batched_tiles is not None

    def bf16_copy(self) -> torch.Tensor | None:
        """The bf16 copy of the weight as a plain [N, K] tensor, whichever layout keeps it."""
        if self.batched_tiles is not None:
            return from_amx_tiles(self.batched_tiles)
        if self.batched_slices is not None:
            return torch.cat([w.to_dense() if w.is_mkldnn else w for w in self.batched_slices])
        return None

    def panel_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the native kernel's panels (for counting the bytes a call
        streams); none where the layer has no panels."""
        return list(self._panel_parts) if self.panels is not None else []

    def bf16_copy_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the bf16 copy (for counting its bytes)."""
        if self.batched_tiles is not None:
            return [self.batched_tiles]
        return list(self.batched_slices or ())

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features
