"""Linear layers, y = x W^T + b, with W kept in the layout its matmul library wants.

On CPU, torch's `F.linear` hands an fp32 matmul to MKL, which re-packs the weight into its
own panel layout on every call. At the narrow batches of decode steps (1-64 rows) that
re-pack costs about as much as the arithmetic. oneDNN can take the weight packed once, at
load time, as vLLM's CPU backend and inductor's freezing pass do. On this model's
projections, a 30-layer chain of them ran 1.5-2.2x faster prepacked at 1-64 rows and as fast
or slightly faster at 512-2,048 (`benchmarks/linear_layout.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# oneDNN picks its packed layout for a typical batch; one layout serves every batch size. A
# hint of 512 rows was as fast as 1 or 32 from 8 to 512 rows, and unlike 32 it does not lose
# to F.linear on prefill-sized batches (benchmarks/linear_layout.py).
_PACK_BATCH_HINT = 512


def onednn_prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacking is used for CPU float32, the case it was measured on. bf16 CPU matmuls
    already go through oneDNN (unpacked); whether packing pays there is not measured."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prepack: bool = False) -> None:
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias = bias
        self.prepacked = prepack
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
                       if prepack else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features
