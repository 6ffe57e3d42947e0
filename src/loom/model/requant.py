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
  block's fp16 ones. Q4_K keeps its own numbers, in blocks of 32 that the native matmul's
  Q4_K records are made from (weights.py; both products exact in fp32, so every weight is
  the file's, at 4.625 bits a weight in the records against the file's 4.5):

      Q4_K block of 256: [ d, dmin (fp16) | sc_j, m_j (6 bits, j = 0..7) | 256 codes 0..15 ]
      -> 8 Q4_K blocks:  [ d, dmin | sc_j, m_j (a byte each) | codes 32j .. 32j + 31 ]

  Q6_K too, with its int8 scale per 16 weights (two a block), in its records at 6.625 bits a
  weight against the file's 6.5625 (Q8_0 took 8.5); but a mixture of experts' 3-D tensors,
  whose kernel has no Q6_K records, are quantized again to Q8_0 as below.

  Q5_K's products are rounded to fp16 (at most 2^-11 of each). Its 5-bit codes and Q5_1's go
  to I8 blocks (int8 codes with an offset), Q5_0's, counted
  from 16, to Q8_0 blocks. IQ4_NL and IQ4_XS hold 4-bit indices into a table of 16 int8
  levels: the levels are Q8_0 codes, with IQ4_NL's scale as it is and IQ4_XS's (d times a
  6-bit scale less 32, per 32 weights) rounded to fp16.
- **Quantized again.** Q3_K and Q2_K scale every 16 weights, the IQ1-IQ3 types pick
  their weights from grids, the TQ types are ternary: none is a block of 32 with one scale.
  Their exact weights are quantized again per 32, to 8-bit codes and one scale,
  max |w| / 127 (Q8_0), which moves each weight by at most half that step.

`benchmarks/kernels/native_accuracy.py --reference F16.gguf --model X.gguf` measures what either
costs on a model's logits (docs/gguf-types.md has the figures).
"""

from __future__ import annotations

import numpy as np
import torch

from loom.model.kernels import gguf_blocks_ops
from loom.model.weights import BlockQuantWeight

FILE_KINDS = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF types the native matmul reads as they are
SAME_CODES = {"Q4_K": "Q4_K", "Q6_K": "Q6_K", "Q5_K": "I8", "Q5_1": "I8", "Q5_0": "Q8_0",
              "IQ4_NL": "Q8_0", "IQ4_XS": "Q8_0"}
QUANTIZED_AGAIN = ("Q3_K", "Q2_K", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS",
                   "IQ1_M", "IQ1_S", "TQ2_0", "TQ1_0")
CONVERTED_KINDS = (*SAME_CODES, *QUANTIZED_AGAIN)

_ROWS_PER_CHUNK = 2048  # bounds the fp32 copy a chunk of rows takes while gguf decodes it


def conversion(kind: str) -> str:
    """What loading does to a tensor of `kind` (one of CONVERTED_KINDS), in a few words."""
    if kind == SAME_CODES.get(kind):
        return f"{kind} in blocks of 32"
    if kind in SAME_CODES:
        return f"{kind} as {SAME_CODES[kind]}"
    return f"{kind} quantized again to Q8_0"


def converts_here() -> bool:
    """Whether the conversion's compiled kernel (csrc/gguf_blocks.cpp) runs on this machine."""
    return gguf_blocks_ops() is not None


def native_blocks(kind: str, data: np.ndarray, shape: tuple[int, ...]) -> BlockQuantWeight:
    """A tensor of GGUF type `kind` (one of CONVERTED_KINDS; `data` uint8 [*shape[:-1], bytes
    per row]) as blocks the native matmul reads. The compiled kernel reads the bytes of every
    same-code type and of the K types; the IQ and TQ types quantized again are decoded by gguf
    first, a chunk of rows at a time, and their float weights quantized again by the kernel.
    Blocks never cross a row, so a 3-D tensor (a mixture of experts' [E, N, K]) converts as
    its E * N rows: the result is [E * N, K], expert e's rows the e-th N."""
    ops = gguf_blocks_ops()
    if ops is None:
        raise RuntimeError("converting GGUF blocks needs loom's compiled gguf_blocks.cpp")
    native = SAME_CODES.get(kind, "Q8_0")
    if kind == "Q6_K" and len(shape) == 3:  # experts: the MoE kernel has no Q6_K records
        kind, native = "Q6_K as Q8_0", "Q8_0"
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    data = data.reshape(rows, -1)
    if kind not in QUANTIZED_AGAIN or kind in ops.kinds:  # the kernel reads the bytes
        return BlockQuantWeight(torch.from_numpy(ops.native_blocks(data, kind, cols)), native)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    chunks = [ops.requantized_q8_0(dequantize(data[r:r + _ROWS_PER_CHUNK],
                                              GGMLQuantizationType[kind]).reshape(-1, cols))
              for r in range(0, rows, _ROWS_PER_CHUNK)]
    return BlockQuantWeight(torch.from_numpy(np.concatenate(chunks)), native)
