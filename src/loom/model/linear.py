"""Linear layers, y = x W^T + b, with W kept in the layout its matmul library wants.

On CPU, torch's `F.linear` hands an fp32 matmul to MKL, which re-packs the weight into its
own panel layout on every call. At the narrow batches of decode steps (1-64 rows) that
re-pack costs about as much as the arithmetic. oneDNN can take the weight packed once, at
load time, as vLLM's CPU backend and inductor's freezing pass do. On this model's
projections, a 30-layer chain of them ran 1.5-2.2x faster prepacked at 1-64 rows and as fast
or slightly faster at 512-2,048 (`benchmarks/linear_layout.py`).

When the weight came from a GGUF in a block-quantized format, small batches go to loom's
native kernel instead, which reads the file's int8 codes (a quarter of the fp32 bytes) and
computes in fp32: about 2x the prepacked layout at 1-8 rows, even near 28 rows, behind above.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from loom.model.loader import BlockQuantWeight

# oneDNN picks its packed layout for a typical batch; one layout serves every batch size. A
# hint of 512 rows was as fast as 1 or 32 from 8 to 512 rows, and unlike 32 it does not lose
# to F.linear on prefill-sized batches (benchmarks/linear_layout.py).
_PACK_BATCH_HINT = 512

# The native block-quantized kernel takes batches up to this many rows; oneDNN took over between
# 24 and 32 (benchmarks/linear_layout.py).
BLOCK_QUANT_MAX_ROWS = 24


def onednn_prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacking is used for CPU float32, the case it was measured on. bf16 CPU matmuls
    already go through oneDNN (unpacked); whether packing pays there is not measured."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prepack: bool = False, block_quant: BlockQuantWeight | None = None,
                 block_quant_ops: ModuleType | None = None) -> None:
        """block_quant (with the compiled block_quant_ops): the same weight in the GGUF's
        format, for batches of up to BLOCK_QUANT_MAX_ROWS rows."""
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias = bias
        self.prepacked = prepack
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
                       if prepack else weight)
        self.block_quant = block_quant if block_quant_ops is not None else None
        self._block_quant_ops = block_quant_ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bq = self.block_quant
        if bq is not None and x.dim() == 2 and x.shape[0] <= BLOCK_QUANT_MAX_ROWS:
            return self._block_quant_ops.block_quant_linear(x, bq.codes, bq.scale, bq.offset,
                                                            self.bias)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features
