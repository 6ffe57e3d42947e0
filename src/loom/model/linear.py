"""Linear layers, y = x W^T + b, with W kept in the layout its matmul library wants.

On CPU, torch's `F.linear` hands an fp32 matmul to MKL, which re-packs the weight into its
own panel layout on every call. At the narrow batches of decode steps (1-64 rows) that
re-pack costs about as much as the arithmetic. oneDNN can take the weight packed once, at
load time, as vLLM's CPU backend and inductor's freezing pass do. On this model's
projections, a 30-layer chain of them ran 1.5-2.2x faster prepacked at 1-64 rows and as fast
or slightly faster at 512-2,048 (`benchmarks/linear_layout.py`).

When the weight came from a GGUF in a block-quantized format, every batch goes to loom's
native kernel instead (csrc/block_quant_linear.cpp), which computes in fp32 from the file's
int8 codes, re-laid out in panels of 16 output channels. It reads a quarter of the fp32 bytes
and keeps a register tile busy: 1.5-2.1x the prepacked layout at 1-16 rows, 1.2-1.4x at
24-128, and within 6% of it at prefill sizes. The fp32 weight is then not kept at all.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from loom.model.weights import BlockQuantWeight

# oneDNN picks its packed layout for a typical batch; one layout serves every batch size. A
# hint of 512 rows was as fast as 1 or 32 from 8 to 512 rows, and unlike 32 it does not lose
# to F.linear on prefill-sized batches (benchmarks/linear_layout.py).
_PACK_BATCH_HINT = 512

# Output channels per panel of the native kernel's weight layout.
PANEL_CHANNELS = 16


def onednn_prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacking is used for CPU float32, the case it was measured on. bf16 CPU matmuls
    already go through oneDNN (unpacked); whether packing pays there is not measured."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def to_panels(bq: BlockQuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native kernel's layout of a [N, K] block-quantized weight: codes [N/16, K, 16] and
    scale/offset [N/16, K/32, 16], so that one k of a panel is 16 adjacent bytes."""
    n = bq.codes.shape[0] // PANEL_CHANNELS
    return tuple(t.view(n, PANEL_CHANNELS, t.shape[1]).transpose(1, 2).contiguous()
                 for t in (bq.codes, bq.scale, bq.offset))


class Linear:
    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                 prepack: bool = False, block_quant: BlockQuantWeight | None = None,
                 block_quant_ops: ModuleType | None = None) -> None:
        """block_quant (with the compiled block_quant_ops): the same weight in the GGUF's
        format; when `uses_panels` says so, every matmul uses it and `weight` is not kept
        (it may then be None)."""
        self.bias = bias
        self.panels: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if self.uses_panels(block_quant, block_quant_ops):
            self.out_features, self.in_features = block_quant.codes.shape
            self.panels = to_panels(block_quant)
            self._block_quant_ops = block_quant_ops
            self.weight, self.prepacked = None, False
            return
        if weight is None:
            raise ValueError("a Linear needs its fp32 weight unless it runs on panels")
        self.out_features, self.in_features = weight.shape
        self.prepacked = prepack
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
                       if prepack else weight)

    @staticmethod
    def uses_panels(block_quant: BlockQuantWeight | None,
                    block_quant_ops: ModuleType | None) -> bool:
        """Whether the native kernel takes this weight: compiled, and whole panels."""
        return (block_quant is not None and block_quant_ops is not None
                and block_quant.codes.shape[0] % PANEL_CHANNELS == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            out = self._block_quant_ops.block_quant_linear(
                x.reshape(-1, self.in_features), *self.panels, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features
