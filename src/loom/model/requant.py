"""GGUF block types the native matmul does not read, re-expressed at load as ones it does.

The native matmul computes with blocks of 32 weights of the form w = code * scale + offset
(Q4_0, Q4_1, Q8_0 and I8: weights.py). Most GGUF files people download hold other types: the
K-quants (Q4_K_M is mostly Q4_K with some Q6_K, Q5_K_M Q5_K with Q6_K), and, in tensors
whose rows are not a multiple of 256 weights long, llama.cpp's fallbacks Q5_0 and Q5_1.
Without this they were dequantized to fp32 at load: four to seven times the bytes each
decode step streams, on torch's matmul.

Two ways, by type:

- **Same codes.** Q5_0 and Q5_1 already have one fp16 scale (and offset) per 32 weights.
  Q4_K and Q5_K scale per 32 weights too, as a 6-bit scale and min times their 256-weight
  block's fp16 ones; their product is rounded to fp16 (at most 2^-11 of it) and the codes are
  kept as they are:

      Q4_K block of 256: [ d, dmin (fp16) | sc_j, m_j (6 bits, j = 0..7) | 256 codes 0..15 ]
      -> 8 Q4_1 blocks:  [ fp16(d sc_j), fp16(-dmin m_j) | codes 32j .. 32j + 31 ]

  Q5_K's 5-bit codes and Q5_1's go to I8 blocks (int8 codes with an offset), Q5_0's, counted
  from 16, to Q8_0 blocks.
- **Quantized again.** Q6_K, Q3_K and Q2_K scale every 16 weights, which a block of 32 cannot
  hold: their exact weights are quantized again per 32, to 8-bit codes and one scale,
  max |w| / 127 (Q8_0), which moves each weight by at most half that step.

`benchmarks/requant_accuracy.py` measures what either costs on a model's logits.
"""

from __future__ import annotations

import numpy as np
import torch

from loom.model.weights import BlockQuantWeight

SAME_CODES = {"Q4_K": "Q4_1", "Q5_K": "I8", "Q5_1": "I8", "Q5_0": "Q8_0"}
QUANTIZED_AGAIN = ("Q6_K", "Q3_K", "Q2_K")
CONVERTED_KINDS = (*SAME_CODES, *QUANTIZED_AGAIN)

_GROUP = 32
_ROWS_PER_CHUNK = 2048  # bounds the fp32 copy a chunk of rows takes while it is converted


def native_blocks(kind: str, data: np.ndarray, shape: tuple[int, int]) -> BlockQuantWeight:
    """A 2-D tensor of GGUF type `kind` (one of CONVERTED_KINDS; `data` uint8 [rows, bytes per
    row]) as blocks the native matmul reads."""
    rows, cols = shape
    chunks = [_convert(kind, data[r:r + _ROWS_PER_CHUNK], cols)
              for r in range(0, rows, _ROWS_PER_CHUNK)]
    return BlockQuantWeight(torch.cat([c.blocks for c in chunks]), chunks[0].kind)


def _convert(kind: str, data: np.ndarray, cols: int) -> BlockQuantWeight:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    weights = dequantize(data, GGMLQuantizationType[kind]).astype(np.float32, copy=False)
    weights = weights.reshape(data.shape[0], cols // _GROUP, _GROUP)
    if kind in QUANTIZED_AGAIN:
        return _quantized_again(weights)
    scale, offset = _scales(kind, data, cols)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.rint((weights - offset[..., None]) / scale[..., None])
    codes[scale == 0] = 0  # every weight of such a group is its offset
    return _blocks(codes, scale, offset, SAME_CODES[kind])


def _scales(kind: str, data: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset) float32 [rows, cols / 32], exact, with w = code * scale + offset."""
    rows = data.shape[0]
    if kind in ("Q5_0", "Q5_1"):
        blocks = data.reshape(rows, cols // _GROUP, -1)
        scale = _fp16(blocks, 0)
        # Q5_0's codes count from 16: taken signed (w = (q - 16) d), they need no offset
        offset = _fp16(blocks, 2) if kind == "Q5_1" else np.zeros_like(scale)
        return scale, offset
    from gguf.quants import Q4_K  # Q5_K packs its 6-bit scales and mins as Q4_K does

    blocks = data.reshape(rows, cols // 256, -1)
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    scale = d[..., None] * sc.reshape(*d.shape, 8).astype(np.float32)
    offset = -dmin[..., None] * m.reshape(*d.shape, 8).astype(np.float32)
    return scale.reshape(rows, -1), offset.reshape(rows, -1)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """float32 [...] from the fp16 at byte `start` of each block."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0] \
        .astype(np.float32)


def _quantized_again(weights: np.ndarray) -> BlockQuantWeight:
    """Symmetric 8-bit codes per group of 32, the scale rounded up to an fp16 value so that
    no code passes 127."""
    amax = np.abs(weights).max(axis=-1)
    scale = (amax / 127).astype(np.float16)
    short = scale.astype(np.float32) * 127 < amax
    scale[short] = np.nextafter(scale[short], np.float16(np.inf))
    scale = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.clip(np.rint(weights / scale[..., None]), -127, 127)
    codes[scale == 0] = 0
    return _blocks(codes, scale, np.zeros_like(scale), "Q8_0")


def _blocks(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray, kind: str
            ) -> BlockQuantWeight:
    rows = codes.shape[0]
    return BlockQuantWeight.from_codes(
        torch.from_numpy(codes.astype(np.int8).reshape(rows, -1)),
        torch.from_numpy(scale.astype(np.float16).astype(np.float32)),
        torch.from_numpy(offset.astype(np.float16).astype(np.float32)), kind)
