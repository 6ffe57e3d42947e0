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
  from 16, to Q8_0 blocks. IQ4_NL and IQ4_XS hold 4-bit indices into a table of 16 int8
  levels: the levels are Q8_0 codes, with IQ4_NL's scale as it is and IQ4_XS's (d times a
  6-bit scale less 32, per 32 weights) rounded to fp16.
- **Quantized again.** Q6_K, Q3_K and Q2_K scale every 16 weights, the IQ1-IQ3 types pick
  their weights from grids, the TQ types are ternary: none is a block of 32 with one scale.
  Their exact weights are quantized again per 32, to 8-bit codes and one scale,
  max |w| / 127 (Q8_0), which moves each weight by at most half that step.

`benchmarks/native_accuracy.py --reference F16.gguf --model X.gguf` measures what either costs
on a model's logits (docs/gguf-types.md has the figures).
"""

from __future__ import annotations

import numpy as np
import torch

from loom.model.weights import BlockQuantWeight

FILE_KINDS = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF types the native matmul reads as they are
SAME_CODES = {"Q4_K": "Q4_1", "Q5_K": "I8", "Q5_1": "I8", "Q5_0": "Q8_0", "IQ4_NL": "Q8_0",
              "IQ4_XS": "Q8_0"}
QUANTIZED_AGAIN = ("Q6_K", "Q3_K", "Q2_K", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS",
                   "IQ1_M", "IQ1_S", "TQ2_0", "TQ1_0")
CONVERTED_KINDS = (*SAME_CODES, *QUANTIZED_AGAIN)

_GROUP = 32
_ROWS_PER_CHUNK = 2048  # bounds the copies a chunk of rows takes while it is converted


def conversion(kind: str) -> str:
    """What loading does to a tensor of `kind` (one of CONVERTED_KINDS), in a few words."""
    if kind in SAME_CODES:
        return f"{kind} as {SAME_CODES[kind]}"
    return f"{kind} quantized again to Q8_0"


def native_blocks(kind: str, data: np.ndarray, shape: tuple[int, int]) -> BlockQuantWeight:
    """A 2-D tensor of GGUF type `kind` (one of CONVERTED_KINDS; `data` uint8 [rows, bytes per
    row]) as blocks the native matmul reads."""
    rows, cols = shape
    chunks = [_convert(kind, data[r:r + _ROWS_PER_CHUNK], cols)
              for r in range(0, rows, _ROWS_PER_CHUNK)]
    return BlockQuantWeight(torch.cat([c.blocks for c in chunks]), chunks[0].kind)


def _convert(kind: str, data: np.ndarray, cols: int) -> BlockQuantWeight:
    if kind in QUANTIZED_AGAIN:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        weights = dequantize(data, GGMLQuantizationType[kind]).astype(np.float32, copy=False)
        return _quantized_again(weights.reshape(data.shape[0], cols // _GROUP, _GROUP))
    rows = data.shape[0]
    weights_per_block, read = _SAME_CODE_READERS[kind]
    codes, scale, offset = read(kind, data.reshape(rows, cols // weights_per_block, -1))
    return _blocks(codes.reshape(rows, cols), scale.reshape(rows, -1),
                   offset.reshape(rows, -1), SAME_CODES[kind])


# The codes are read straight from the blocks' bits (gguf's decoders make float weights, which
# took most of a K-quant model's load); test_requant checks them against gguf's decoders.

def _q5_blocks(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Codes [..., 32], scale and offset [...] of Q5_0 ([d, qh, qs]) or Q5_1 ([d, m, qh, qs])
    blocks: the low 4 bits in qs (input j's in byte j's low nibble, input j + 16's in its
    high one), the fifth as bit j of qh. Q5_0's codes count from 16: taken signed, they need
    no offset."""
    header = 2 if kind == "Q5_0" else 4
    qs = blocks[..., header + 4:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    high = np.unpackbits(blocks[..., header:header + 4], axis=-1, bitorder="little")
    codes = (low | (high << 4)).astype(np.int8)
    scale = _fp16(blocks, 0)
    if kind == "Q5_0":
        return codes - np.int8(16), scale, np.zeros_like(scale)
    return codes, scale, _fp16(blocks, 2)


def _k_blocks(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Codes [..., 8, 32], scales and offsets [..., 8] of Q4_K ([d, dmin, 12 bytes of 6-bit
    scales and mins, 128 of codes]) or Q5_K (the same with 32 bytes of fifth bits before the
    codes) blocks of 256: sub-block 2i's codes are the low nibbles of code bytes 32i..32i+31,
    sub-block 2i + 1's their high ones; sub-block s's fifth bits are bit s of the 32 bytes."""
    from gguf.quants import Q4_K  # Q5_K packs its 6-bit scales and mins as Q4_K does

    qs = blocks[..., 48:] if kind == "Q5_K" else blocks[..., 16:]
    nibbles = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    codes = (nibbles & 0x0F).reshape(*qs.shape[:-1], 8, 32)
    if kind == "Q5_K":
        qh = blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]
        codes = codes | ((qh & 1) << 4)
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    scale = d[..., None] * sc.reshape(*d.shape, 8).astype(np.float32)
    offset = -dmin[..., None] * m.reshape(*d.shape, 8).astype(np.float32)
    return codes.astype(np.int8), scale, offset


# IQ4_NL's and IQ4_XS's 16 levels: a 4-bit index picks one (llama.cpp's kvalues_iq4nl)
_IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                        113], np.int8)


def _iq4_blocks(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Codes [..., 32] (or [..., 8, 32]), scales and offsets of IQ4_NL ([d, 16 bytes of
    indices], 32 weights) or IQ4_XS ([d, 2 bytes of the scales' high bits, 4 of their low
    ones, 8 x 16 bytes of indices], 256) blocks: each code is the level its 4-bit index picks,
    input j's in byte j's low nibble and input j + 16's in its high one. IQ4_XS scales every
    32 weights by d times a 6-bit scale less 32."""
    qs = blocks[..., 2:] if kind == "IQ4_NL" else blocks[..., 8:].reshape(*blocks.shape[:-1], 8,
                                                                          16)
    codes = _IQ4_LEVELS[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)]
    d = _fp16(blocks, 0)
    if kind == "IQ4_NL":
        return codes, d, np.zeros_like(d)
    low = (blocks[..., 4:8, None] >> np.array([0, 4], np.uint8)) & 0x0F  # sub-blocks 2i, 2i + 1
    high_bits = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)
    high = (high_bits >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    sub_scale = (low.reshape(high.shape) | (high << 4)).astype(np.float32) - 32
    scale = d[..., None] * sub_scale
    return codes, scale, np.zeros_like(scale)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """float32 [...] from the fp16 at byte `start` of each block."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0] \
        .astype(np.float32)


# per same-code kind: the weights in one of its blocks, and what reads them
_SAME_CODE_READERS = {"Q5_0": (_GROUP, _q5_blocks), "Q5_1": (_GROUP, _q5_blocks),
                      "Q4_K": (256, _k_blocks), "Q5_K": (256, _k_blocks),
                      "IQ4_NL": (_GROUP, _iq4_blocks), "IQ4_XS": (256, _iq4_blocks)}


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
