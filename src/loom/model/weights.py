"""Weights as the loader hands them to the model: named tensors made on first use, and a GGUF's
block-quantized matrices kept in the file's own format."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from loom.model.arch import ModelArch
from loom.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class BlockQuantWeight:
    """A weight matrix as a GGUF file stores it: int8 codes with one scale and one offset per
    block of 32 along each row, w = codes * scale + offset. Q4_0, Q4_1 and Q8_0 all have this
    form, so the native matmul (csrc/block_quant_linear.cpp) computes with the file's own
    numbers, a quarter of the bytes of the fp32 weights."""

    codes: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in // 32]
    offset: torch.Tensor  # float32 [out, in // 32]

    @staticmethod
    def cat(parts: list[BlockQuantWeight]) -> BlockQuantWeight:
        """Stacked along the output rows, as the fused qkv and gate_up projections are."""
        return BlockQuantWeight(*(torch.cat([getattr(p, f) for p in parts])
                                  for f in ("codes", "scale", "offset")))

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight: bit for bit what gguf's dequantize gives for these blocks, at a
        fraction of its time and memory."""
        rows, cols = self.codes.shape
        blocks = self.codes.float().view(rows, cols // 32, 32)
        return blocks.mul_(self.scale[..., None]).add_(self.offset[..., None]).view(rows, cols)


class LazyWeights(Mapping[str, torch.Tensor]):
    """Named tensors, each made on first access and then kept (so two users of one name, like
    a tied embedding and lm_head, share it). Names and `in` cost nothing."""

    def __init__(self, makers: Mapping[str, Callable[[], torch.Tensor]]) -> None:
        self._makers = dict(makers)
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._made:
            self._made[name] = self._makers[name]()
        return self._made[name]

    def __contains__(self, name: object) -> bool:
        return name in self._makers  # Mapping's default would make the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


@dataclass
class LoadedModel:
    arch: ModelArch
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str
    # The GGUF's Q4_0/Q4_1/Q8_0 weights in their own format, by the same names as `weights`.
    block_quant: dict[str, BlockQuantWeight] = field(default_factory=dict)
