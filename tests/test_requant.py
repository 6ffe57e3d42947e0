"""GGUF types the native matmul does not read, converted at load (loom/model/requant.py),
against gguf's own dequantize of the same bytes: Q4_K keeps every weight; Q5_K, Q5_0, Q5_1,
IQ4_NL and IQ4_XS keep every code, so the only change is the fp16 rounding of a scale or offset
(none where those are fp16 values already); the types quantized again to 8 bits move no weight
by more than half a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from loom.model import requant
from loom.model.requant import CONVERTED_KINDS, QUANTIZED_AGAIN, SAME_CODES, native_blocks

pytestmark = pytest.mark.unit

# Byte offsets of each type's fp16 fields in a block (the rest, codes, grid indices and packed
# sub-scales, may hold any bytes). IQ1_M's one is spread over the top nibbles of four uint16
# from its byte 48 (write_fp16).
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q6_K": (208,),
               "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_S": (0,),
               "IQ3_XXS": (0,), "IQ2_S": (0,), "IQ2_XS": (0,), "IQ2_XXS": (0,), "IQ1_S": (0,),
               "IQ1_M": (48,), "TQ2_0": (64,), "TQ1_0": (52,)}


def write_fp16(blocks: np.ndarray, kind: str, start: int, values: np.ndarray) -> None:
    """Set the fp16 field at byte `start` of each block (uint8 [blocks, type size])."""
    bits = np.asarray(values, np.float64).astype(np.float16).view(np.uint16)
    if kind != "IQ1_M":
        blocks[:, start:start + 2] = bits[:, None].view(np.uint8)
        return
    for i in range(4):  # nibble i in the top nibble of uint16 scale i (its second byte)
        byte = blocks[:, start + 2 * i + 1]
        blocks[:, start + 2 * i + 1] = (byte & 0x0F) | (((bits >> (4 * i)) & 0x0F) << 4)


def random_blocks(kind: str, rows: int, cols: int, seed: int,
                  fp16: tuple[float, float] | None = None) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid random blocks: random codes and sub-scales; the
    fp16 fields drawn from `fp16` (low, high), or each a power of two when None, so that any
    6-bit multiple of them is an fp16 value too."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for start in FP16_FIELDS[kind]:
        if fp16 is None:
            values = 2.0 ** rng.integers(-14, -8, len(blocks))
        else:
            values = rng.uniform(*fp16, len(blocks))
        if kind == "Q5_1" and start == 2:
            values = values * rng.choice([-1, 1], len(blocks))  # Q5_1's offset has a sign
        write_fp16(blocks, kind, start, values)
    return blocks.reshape(rows, -1)


def exact(kind: str, data: np.ndarray, cols: int) -> np.ndarray:
    return dequantize(data, GGMLQuantizationType[kind]).reshape(len(data), cols)


@pytest.mark.parametrize("kind", sorted(SAME_CODES))
def test_codes_kept_as_they_are_give_the_files_weights_bit_for_bit(kind: str) -> None:
    """Where the scales and offsets are fp16 values, the converted blocks dequantize to what
    gguf gives, bit for bit: every code in its place."""
    data = random_blocks(kind, 16, 512, seed=1)
    bq = native_blocks(kind, data, (16, 512))
    assert bq.kind == SAME_CODES[kind]
    np.testing.assert_array_equal(bq.dequantize().numpy(), exact(kind, data, 512))


def test_q4_k_keeps_every_weight_whatever_its_scales() -> None:
    """Q4_K's blocks of 32 keep its fp16 d and dmin and 6-bit scale and min: its weights are
    gguf's bit for bit where d * scale is no fp16 value, too."""
    data = random_blocks("Q4_K", 16, 512, seed=2, fp16=(1e-4, 2e-3))
    bq = native_blocks("Q4_K", data, (16, 512))
    assert not torch.equal(bq.scale.half().float(), bq.scale)  # products beyond fp16
    np.testing.assert_array_equal(bq.dequantize().numpy(), exact("Q4_K", data, 512))


@pytest.mark.parametrize("kind", ["Q5_K", "IQ4_XS"])
def test_k_quant_scales_are_only_rounded_to_fp16(kind: str) -> None:
    """A 256-block's fp16 scale times a 6-bit one is rounded to fp16: no weight moves by more
    than that rounding (2^-11 of the scale, times the largest code, plus that of the
    offset)."""
    data = random_blocks(kind, 16, 512, seed=2, fp16=(1e-4, 2e-3))
    bq = native_blocks(kind, data, (16, 512))
    want = exact(kind, data, 512)
    got = bq.dequantize().numpy()
    largest_code = {"Q5_K": 31, "IQ4_XS": 127}[kind]
    bound = np.repeat(largest_code * np.abs(bq.scale.numpy()) + np.abs(bq.offset.numpy()),
                      32, axis=1) * 2.0 ** -11
    assert (np.abs(got - want) <= bound * (1 + 1e-6) + 1e-9).all()
    assert not np.array_equal(got, want)  # the test's scales are not all fp16 values


@pytest.mark.parametrize("kind", QUANTIZED_AGAIN)
def test_types_quantized_again_move_by_at_most_half_a_step(kind: str) -> None:
    """Q6_K, Q3_K and Q2_K scale every 16 weights; the IQ1-3 types pick codes from grids, the
    TQ types hold -1, 0 or 1: none fits a block of 32 with one scale."""
    data = random_blocks(kind, 16, 512, seed=3, fp16=(1e-3, 1e-2))
    bq = native_blocks(kind, data, (16, 512))
    assert bq.kind == "Q8_0"
    want = exact(kind, data, 512)
    step = np.repeat(bq.scale.numpy(), 32, axis=1)
    assert (np.abs(bq.dequantize().numpy() - want) <= step / 2 * (1 + 1e-6)).all()
    codes = bq.codes
    assert int(codes.abs().max()) <= 127
    # each code is w / scale rounded to the nearest integer (ties to even), in float32
    scale = np.repeat(bq.scale.numpy(), 32, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        nearest = np.where(scale == 0, 0, np.rint(want.astype(np.float32) / scale))
    np.testing.assert_array_equal(codes.numpy(), np.clip(nearest, -127, 127))
    # the scale is the smallest fp16 value at or above max |w| / 127: no code is clipped
    amax = np.abs(want.reshape(16, -1, 32)).max(axis=-1)
    assert (bq.scale.numpy() * 127 >= amax).all()
    assert (bq.scale.numpy() == (amax / 127).astype(np.float16).astype(np.float32)).mean() > 0.3


@pytest.mark.parametrize("kind", CONVERTED_KINDS)
def test_groups_of_zero_scale_hold_their_offset_and_nothing_else(kind: str) -> None:
    data = random_blocks(kind, 8, 256, seed=4)
    blocks = data.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1])
    for start in FP16_FIELDS[kind]:
        if kind != "Q5_1" or start == 0:  # Q5_1: d = 0 leaves w = m
            write_fp16(blocks, kind, start, np.zeros(len(blocks)))
    bq = native_blocks(kind, data, (8, 256))
    got = bq.dequantize().numpy()
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, exact(kind, data, 256))


@pytest.mark.parametrize("kind", ["IQ3_S", "TQ2_0"])
def test_rows_converted_in_chunks_give_the_blocks_of_one_pass(kind: str, monkeypatch) -> None:
    """The types gguf decodes to floats first go a chunk of rows at a time."""
    data = random_blocks(kind, 10, 256, seed=5, fp16=(1e-4, 1e-3))
    whole = native_blocks(kind, data, (10, 256))
    monkeypatch.setattr(requant, "_ROWS_PER_CHUNK", 3)
    chunked = native_blocks(kind, data, (10, 256))
    assert chunked.kind == whole.kind
    assert torch.equal(chunked.blocks, whole.blocks)


def test_the_kernel_names_what_it_cannot_convert() -> None:
    """A type without a conversion, or bytes that are not whole rows of blocks, are refused
    with the reason, not read past."""
    data = random_blocks("Q4_K", 2, 256, seed=6)
    with pytest.raises(ValueError, match="no native conversion for GGUF type Q4_1"):
        native_blocks("Q4_1", data, (2, 256))
    with pytest.raises(ValueError, match=r"data must be uint8 \[rows, 144\]"):
        native_blocks("Q4_K", data[:, :100], (2, 256))
    with pytest.raises(ValueError, match="whole blocks of 256 weights"):
        native_blocks("Q4_K", data, (2, 224))
