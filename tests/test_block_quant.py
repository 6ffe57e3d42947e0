"""The native matmul on a GGUF's block-quantized weights (csrc/block_quant_linear.cpp): the
loader must hand over the file's own codes, scales and offsets; the kernel's fp32 path must
compute what F.linear computes on the dequantized weights, and its int8 path what the same
weights give on the activations quantized as the kernel says (two int8 parts per block of 32),
at every batch size it is given."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_fixtures import TINY_SPECS, build_tiny_model, save_hf_folder, write_gguf

from loom import LLM, SamplingParams
from loom.model.decoder import DecoderModel
from loom.model.kernels import block_quant_linear_ops, fused_ops
from loom.model.linear import (
    BF16_ABOVE_ROWS,
    BF16_ABOVE_ROWS_AMX,
    INT8_MAX_ROWS,
    Linear,
    to_panels,
)
from loom.model.loader import (
    _hf_name,
    _permuted_heads,
    _unpermute_rope,
    load_model,
)
from loom.model.weights import FOUR_BIT_KINDS, BlockQuantWeight

ops = block_quant_linear_ops()
needs_kernel = pytest.mark.skipif(ops is None or not ops.supported(),
                                  reason="no C++ compiler or no AVX2/FMA/F16C")
INT8, FP32 = 1 << 30, 0  # the kernel's int8_rows argument that forces each path

CODES = {"Q4_1": (0, 16), "Q4_0": (-8, 8), "Q8_0": (-128, 128)}


def random_block_quant(out_features: int, in_features: int, seed: int,
                       quant: str = "Q4_1") -> BlockQuantWeight:
    """Codes in the format's range; fp16 scales (positive) and offsets (negative, Q4_1 only),
    as a GGUF holds them."""
    gen = torch.Generator().manual_seed(seed)
    blocks = (out_features, in_features // 32)
    low, high = CODES[quant]
    offset = -torch.rand(blocks, generator=gen) * 0.15 if quant == "Q4_1" else torch.zeros(blocks)
    return BlockQuantWeight.from_codes(
        codes=torch.randint(low, high, (out_features, in_features), generator=gen,
                            dtype=torch.int8),
        scale=(torch.rand(blocks, generator=gen) * 0.02 + 0.001).half().float(),
        offset=offset.half().float())


def two_part_x(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path holds it, in float64 [rows, in // 32, 32]: per row and block of 32,
    t = x * 127 / max|x|, q1 = round(t), q2 = round(256 (t - q1)) clipped to +-127,
    x ~ (256 q1 + q2) max|x| / 32512."""
    blocks = x.view(x.shape[0], x.shape[1] // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    t = blocks * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q1 = torch.round(t)
    q2 = torch.round((t - q1) * 256).clamp(-127, 127)
    return (256 * q1.double() + q2.double()) * (amax.double() / (127 * 256))


def two_part_reference(x: torch.Tensor, bq: BlockQuantWeight) -> torch.Tensor:
    """What the int8 path computes, in float64: the codes' part with x's two-part values
    (two_part_x), the offset's with the exact sum of x. 4-bit codes count from 8
    (q - 8 with offset + 8 * scale: the same weights)."""
    blocks = x.view(x.shape[0], x.shape[1] // 32, 32)
    xq = two_part_x(x)
    codes, offset, scale = bq.codes.double(), bq.offset.double(), bq.scale.double()
    if int(bq.codes.min()) >= -8 and int(bq.codes.max()) <= 15:
        shift = 8.0 if int(bq.codes.min()) >= 0 else 0.0  # Q4_0's are signed already
        codes, offset = codes - shift, offset + shift * scale
    weights = codes.view(codes.shape[0], -1, 32) * scale[..., None]
    return (torch.einsum("rbk,nbk->rn", xq, weights)
            + blocks.double().sum(-1) @ offset.T).float()


@pytest.mark.unit
@needs_kernel
@pytest.mark.parametrize("quant", list(CODES))
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 14, 17, 32, 40])
# (80, 640): the int8 path's work units are 3 panels there, so 4 units, the last of one panel,
# each thread prefetching the unit it takes next
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 64), (48, 96), (80, 640)])
def test_kernel_paths_match_their_references(quant: str, rows: int, out_features: int,
                                             in_features: int) -> None:
    """Every row tile and remainder of both paths, with and without bias: the fp32 path is
    F.linear on the dequantized weights, the int8 path the two-part reference, each to fp32
    rounding; and the int8 path is within int16-like precision of the fp32 product."""
    bq = random_block_quant(out_features, in_features, seed=rows, quant=quant)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, in_features, generator=gen)
    x[:, 5] *= 30  # an outlier channel, as real activations have
    bias = torch.randn(out_features, generator=gen)
    panels = to_panels(bq, ops)
    exact = F.linear(x, bq.dequantize())
    scale = exact.abs().amax().item() if rows else 1.0  # fp32 rounding is relative to it
    growth = max(1.0, in_features / 96)  # ... and grows with the inputs summed, past 3 blocks
    for b in (None, bias):
        extra = 0 if b is None else b
        fp32 = ops.block_quant_linear(x, panels, b, FP32)
        int8 = ops.block_quant_linear(x, panels, b, INT8)
        torch.testing.assert_close(fp32, exact + extra, rtol=1e-5, atol=1e-5 * growth)
        torch.testing.assert_close(int8, two_part_reference(x, bq) + extra, rtol=1e-5,
                                   atol=3e-6 * scale * growth)
        torch.testing.assert_close(int8, exact + extra, rtol=0, atol=2e-4 * scale)


def exactly_quantized_rows(rows: int, in_features: int, seed: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, joined): rows that the int8 path quantizes without rounding, x = (q1 + q2 / 256) *
    2^e per block of 32 with the block's first |x| = 127 * 2^e (so dx = 2^e), q1 and q2 over
    their whole range, -127..127, and one block of zeros; joined = 256 q1 + q2 (int64)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, in_features // 32, 32)
    q1 = torch.randint(-127, 128, shape, generator=gen)
    q2 = torch.randint(-127, 128, shape, generator=gen)
    q1[..., 0] = 127 * (torch.randint(0, 2, shape[:2], generator=gen) * 2 - 1)
    q2[..., 0] = 0
    q2 = torch.where(q1.abs() == 127, -q1.sign() * q2.abs(), q2)  # |x| <= 127 * 2^e
    q1[0, 1], q2[0, 1] = 0, 0
    exponent = torch.randint(-3, 4, (*shape[:2], 1), generator=gen).float()
    joined = 256 * q1 + q2
    x = (joined.float() / 256 * 2 ** exponent).reshape(rows, in_features)
    return x, joined


@pytest.mark.unit
@needs_kernel
@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0"])
def test_the_int8_paths_integer_sums_are_exact(quant: str) -> None:
    """With activations it quantizes exactly, unit scales and no offsets, every fp32 step of
    the int8 path after its integer dot products is exact but the conversion of each block's
    sum 256 sum(q * q1) + sum(q * q2) to fp32 and the sums over blocks, in order: the output
    is then known bit for bit, whichever instructions (AVX2 byte and int16 products, VNNI's)
    summed the codes, and at their extremes (codes 0 or 15, -128 or 127; parts +-127) no
    saturation can hide."""
    low, high = CODES[quant]
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(low, high, (80, 640), generator=gen, dtype=torch.int8)
    codes[:, :64] = torch.where(torch.rand(80, 64, generator=gen) < 0.5, low, high - 1)
    ones, zeros = torch.ones(80, 20), torch.zeros(80, 20)
    panels = to_panels(BlockQuantWeight.from_codes(codes, ones, zeros, kind=quant), ops)
    bias = torch.randn(80, generator=gen)
    x, joined = exactly_quantized_rows(13, 640, seed=2)
    dx = x.view(13, 20, 32).abs().amax(-1) / 127
    sums = torch.einsum("rbk,nbk->rbn", joined, codes.long().view(80, 20, 32))
    want = torch.zeros(13, 80)
    for b in range(20):
        want = want + sums[:, b].float() * (dx[:, b, None] / 256)
    want = want + bias
    for rows in (1, 2, 3, 4, 5, 13):
        assert torch.equal(ops.block_quant_linear(x[:rows], panels, bias, INT8), want[:rows])


@needs_kernel
@pytest.mark.unit
def test_calls_from_many_threads_at_once_give_each_its_own_result() -> None:
    """The kernel runs without the GIL on a pool of helpers that serves one call at a time:
    calls that find it busy run on their own thread. Many at once, on both paths and with the
    thread count changed in between, each must still get exactly its own product."""
    import threading

    bq = random_block_quant(256, 512, seed=7)
    panels = to_panels(bq, ops)
    gen = torch.Generator().manual_seed(8)
    inputs = [torch.randn(rows, 512, generator=gen) for rows in (1, 3, 8, 24) * 4]
    expected = [(ops.block_quant_linear(x, panels, None, INT8),
                 ops.block_quant_linear(x, panels, None, FP32)) for x in inputs]
    results: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def call(i: int) -> None:
        results[i] = [(ops.block_quant_linear(inputs[i], panels, None, INT8),
                       ops.block_quant_linear(inputs[i], panels, None, FP32))
                      for _ in range(20)]

    threads_before = torch.get_num_threads()
    try:
        for num_threads in (threads_before, 1, threads_before):
            torch.set_num_threads(num_threads)
            workers = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            for i, (int8, fp32) in enumerate(expected):
                for got_int8, got_fp32 in results[i]:
                    assert torch.equal(got_int8, int8) and torch.equal(got_fp32, fp32)
    finally:
        torch.set_num_threads(threads_before)


@pytest.mark.unit
@needs_kernel
def test_panels_keep_the_files_sizes() -> None:
    """4-bit codes two to a byte and fp16 scales and offsets: Q4_0 and Q4_1 take 20 bytes per
    32 weights (Q4_0 the 4 of its implied offset as well), Q8_0 36."""
    for quant, record in (("Q4_1", 160), ("Q4_0", 160), ("Q8_0", 288)):
        panels = to_panels(random_block_quant(32, 64, seed=1, quant=quant), ops)
        assert panels.dtype == torch.uint8 and panels.shape == (4, 2, record)


def reference_panels(bq: BlockQuantWeight) -> torch.Tensor:
    """The kernel's record layout, spelled out on the unpacked codes (csrc/block_quant_linear.cpp
    describes it): per panel of 8 channels and block of 32 inputs, code groups of 8 channels x
    4 inputs (4-bit: groups 2t and 2t + 1 in the low and high nibbles), then the fp16 scales
    and offsets; 4-bit codes count from 0, so Q4_0's signed ones come shifted by 8."""
    codes, offset = bq.codes, bq.offset
    if bq.kind == "Q4_0":
        codes, offset = codes + 8, offset - 8 * bq.scale
    n, k = codes.shape
    panels, blocks = n // 8, k // 32
    groups = codes.view(panels, 8, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    if bq.kind in ("Q4_0", "Q4_1"):
        pairs = groups.reshape(panels, blocks, 4, 2, 32).to(torch.uint8)
        code_bytes = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)
    else:
        code_bytes = groups.contiguous().view(torch.uint8)
    halves = [t.view(panels, 8, blocks).transpose(1, 2).half().contiguous().view(torch.uint8)
              for t in (bq.scale, offset)]
    return torch.cat([code_bytes.reshape(panels, blocks, -1), *halves], dim=-1)


@needs_kernel
@pytest.mark.unit
@pytest.mark.parametrize("quant", [*CODES, "mixed"])
def test_panels_are_made_from_the_files_blocks(quant: str) -> None:
    """The kernel re-lays the file's blocks out as the layout says, for each kind, and for a
    projection stacked from parts of different kinds (held as int8 codes with offsets)."""
    if quant == "mixed":
        bq = BlockQuantWeight.cat([random_block_quant(16, 96, seed=4, quant="Q4_1"),
                                   random_block_quant(32, 96, seed=5, quant="Q8_0")])
        assert bq.kind == "I8"
    else:
        bq = random_block_quant(48, 96, seed=4, quant=quant)
        assert bq.kind == quant
    torch.testing.assert_close(to_panels(bq, ops), reference_panels(bq), rtol=0, atol=0)


@pytest.mark.unit
@pytest.mark.parametrize("quant", list(CODES))
def test_blocks_hold_the_codes_they_were_made_from(quant: str) -> None:
    """from_codes -> the file's own block bytes -> the same codes, scales and offsets; a stack
    of parts of one kind keeps it, of several kinds dequantizes to the stacked weights."""
    bq = random_block_quant(16, 64, seed=6, quant=quant)
    again = BlockQuantWeight.from_codes(bq.codes, bq.scale, bq.offset)
    assert bq.blocks.shape[-1] == {"Q4_1": 20, "Q4_0": 18, "Q8_0": 34}[quant]
    assert torch.equal(again.blocks, bq.blocks)
    other = random_block_quant(16, 64, seed=7, quant="Q4_1" if quant != "Q4_1" else "Q8_0")
    for parts in ([bq, bq], [bq, other]):
        stacked = BlockQuantWeight.cat(parts)
        torch.testing.assert_close(stacked.dequantize(),
                                   torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)


@pytest.mark.unit
@needs_kernel
def test_kernel_takes_strided_rows_and_refuses_bad_shapes() -> None:
    bq = random_block_quant(16, 64, seed=1)
    panels = to_panels(bq, ops)
    for rows in (5, 9):
        strided = torch.randn(64, rows).t()
        for path in (INT8, FP32):
            torch.testing.assert_close(ops.block_quant_linear(strided, panels, None, path),
                                       ops.block_quant_linear(strided.contiguous(), panels,
                                                              None, path))
    with pytest.raises(RuntimeError, match="panels"):
        ops.block_quant_linear(torch.randn(2, 64), bq.codes, None, INT8)
    with pytest.raises(RuntimeError, match="panels"):
        ops.block_quant_linear(torch.randn(2, 64), panels[:1].contiguous(), None, INT8)
    with pytest.raises(RuntimeError, match="K = 32"):
        ops.block_quant_linear(torch.randn(2, 48), panels, None, INT8)
    with pytest.raises(RuntimeError, match="float32"):
        ops.block_quant_linear(torch.randn(2, 64).double(), panels, None, INT8)
    with pytest.raises(RuntimeError, match="bias"):
        ops.block_quant_linear(torch.randn(2, 64), panels, torch.randn(8), INT8)


@pytest.mark.unit
@needs_kernel
@pytest.mark.parametrize("quant", list(CODES))
def test_linear_uses_the_kernel_at_every_batch_size(quant: str) -> None:
    """A block-quantized form that deliberately differs from the fp32 weight shows which path
    each call took: int8 up to INT8_MAX_ROWS rows for the weight's code width, fp32 above; the
    fp32 weight is not kept. Channels that do not fill whole panel pairs, or no compiled
    kernel, leave the layer on the fp32 weight; scales fp16 cannot hold make no blocks at all."""
    bq = random_block_quant(32, 64, seed=2, quant=quant)
    int8_max_rows = INT8_MAX_ROWS[4 if bq.kind in FOUR_BIT_KINDS else 8]
    other = torch.randn(32, 64)
    linear = Linear(other, None, prepack=False, block_quant=bq, block_quant_ops=ops)
    assert linear.weight is None
    for rows in (1, int8_max_rows, int8_max_rows + 1, 300):
        x = torch.randn(rows, 64)
        path = INT8 if rows <= int8_max_rows else FP32
        torch.testing.assert_close(linear(x), ops.block_quant_linear(x, linear.panels, None,
                                                                     path), rtol=0, atol=0)
        torch.testing.assert_close(linear(x), F.linear(x, bq.dequantize()), rtol=1e-3,
                                   atol=1e-3)
    x3 = torch.randn(2, 3, 64)
    torch.testing.assert_close(linear(x3), F.linear(x3, bq.dequantize()), rtol=1e-3, atol=1e-3)
    assert Linear(other, None, block_quant=bq, block_quant_ops=None).panels is None
    odd = random_block_quant(24, 64, seed=3)
    fallback = Linear(other[:24], None, block_quant=odd, block_quant_ops=ops)
    assert fallback.panels is None
    x = torch.randn(4, 64)
    torch.testing.assert_close(fallback(x), F.linear(x, other[:24]))
    with pytest.raises(ValueError, match="fp16"):
        BlockQuantWeight.from_codes(bq.codes, bq.scale + 1e-6, bq.offset)


@pytest.mark.unit
@needs_kernel
@pytest.mark.parametrize("above", [BF16_ABOVE_ROWS, BF16_ABOVE_ROWS_AMX])
@pytest.mark.parametrize("out_features", [48, 64])
def test_wide_calls_take_the_bf16_copy_and_narrow_ones_the_kernel(above: int,
                                                                  out_features: int) -> None:
    """With bf16_above_rows, calls of up to that many rows stay on the kernel, bit for bit;
    more rows are the bf16 product of the same weights (x and the product rounded to bf16, as
    a bfloat16 model's matmuls are, up to one rounding of a sum: test_fused_ops) plus the bias
    in fp32, in float32 out, flat or not. 64 channels fit AMX blocks of 32 (the AMX kernel's
    copy, where the CPU has it), 48 do not (oneDNN's slices)."""
    bq = random_block_quant(out_features, 96, seed=5)
    bias = torch.randn(out_features)
    linear = Linear(None, bias, block_quant=bq, block_quant_ops=ops, bf16_above_rows=above)
    amx = out_features % 32 == 0 and fused_ops() is not None and fused_ops().amx_available()
    assert (linear.batched_tiles is not None) == amx
    assert (linear.batched_slices is not None) == (not amx)
    torch.testing.assert_close(linear.bf16_copy(), bq.dequantize().bfloat16(), rtol=0, atol=0)
    plain = Linear(None, bias, block_quant=bq, block_quant_ops=ops)
    assert not plain.has_bf16_copy and plain.bf16_copy() is None
    for rows in (1, above):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(linear(x), plain(x), rtol=0, atol=0)
    for rows in (above + 1, 300):
        x = torch.randn(rows, 96)
        out = linear(x)
        assert out.dtype == torch.float32
        product = F.linear(x.bfloat16(), bq.dequantize().bfloat16()).float()
        assert ((out - bias - product).abs() <= product.abs() * 2.0**-7 + 1e-6).all()
        exact = F.linear(x.double(), bq.dequantize().double(), bias.double())
        assert ((out.double() - exact).norm() / exact.norm()) < 1e-2
        assert not torch.equal(out, plain(x))  # not the kernel's product
    x3 = torch.randn(3, above, 96)  # more rows once flattened
    torch.testing.assert_close(linear(x3),
                               linear(x3.reshape(-1, 96)).view(3, above, out_features),
                               rtol=0, atol=0)


@pytest.mark.unit
@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_loader_keeps_the_files_own_blocks(tmp_path, quant: str) -> None:
    """codes * scale + offset is bit for bit what gguf's own reader and dequantize give, q/k
    rows un-permuted; the loader's fp32 weights are those values. Q5_0 and Q5_1, which the
    kernel does not read, come as 8-bit blocks with the same codes (loom/model/requant.py)."""
    import gguf
    from gguf.quants import dequantize

    model = build_tiny_model(TINY_SPECS["llama"])
    path = write_gguf(model, tmp_path / "q.gguf", quant=quant)
    loaded = load_model(str(path))
    matrices = [n for n, w in loaded.weights.items() if w.dim() == 2]
    assert sorted(loaded.block_quant) == sorted(matrices)
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name = _hf_name(tensor.name)
        if name not in loaded.block_quant:
            continue
        expected = dequantize(tensor.data, tensor.tensor_type)
        heads = _permuted_heads(tensor.name, loaded.arch)
        if heads is not None:
            expected = _unpermute_rope(expected, heads)
        bq = loaded.block_quant[name]
        assert bq.kind == {"Q5_0": "Q8_0", "Q5_1": "I8"}.get(quant, quant)
        assert bq.codes.dtype == torch.int8 and bq.scale.dtype == torch.float32
        np.testing.assert_array_equal(bq.dequantize().numpy(), expected)
        np.testing.assert_array_equal(loaded.weights[name].numpy(), expected)


@pytest.mark.integration
@pytest.mark.parametrize("linear_backend", ["onednn", "torch"])
def test_other_backends_never_convert_a_files_blocks(tmp_path, monkeypatch, caplog,
                                                     linear_backend: str) -> None:
    """Only the native matmul reads the converted blocks (requant.py), so an engine on another
    backend never pays for making them; their shapes are known without making them, and the
    native engine on the same file converts each one once."""
    from loom.model import loader
    from loom.model.requant import native_blocks

    path = write_gguf(build_tiny_model(TINY_SPECS["llama"]), tmp_path / "q.gguf", quant="Q5_0")
    converted: list[str] = []

    def recorded(kind: str, data: np.ndarray, shape: tuple[int, int]) -> BlockQuantWeight:
        converted.append(kind)
        return native_blocks(kind, data, shape)

    monkeypatch.setattr(loader, "native_blocks", recorded)
    params = SamplingParams(max_tokens=4, temperature=0)
    other = LLM(model=str(path), kv_cache_memory="16MiB", dtype="float32",
                linear_backend=linear_backend)
    assert other.generate(["hello"], params)[0].outputs[0].token_ids
    assert converted == []
    loaded = load_model(str(path))
    assert all(bq.shape == tuple(loaded.weights[n].shape)  # blocks of the weights' own shape
               for n, bq in loaded.block_quant.items())
    assert len(converted) == len(loaded.block_quant) > 0
    assert loaded.conversions == {"Q5_0 as Q8_0": len(loaded.block_quant)}
    if block_quant_linear_ops() is not None:
        converted.clear()
        with caplog.at_level(logging.INFO, logger="loom.model.runner"):
            native = LLM(model=str(path), kv_cache_memory="16MiB", dtype="float32",
                         linear_backend="native")
        assert native.engine.runner.model.layers[0].qkv.panels is not None
        assert len(converted) == len(loaded.block_quant)
        assert f"{len(converted)} x Q5_0 as Q8_0" in caplog.text  # the user is told


@pytest.mark.unit
def test_without_the_compiled_conversion_converted_types_run_dequantized(tmp_path,
                                                                        monkeypatch) -> None:
    """Where csrc/gguf_blocks.cpp does not build, a type the native matmul reads only
    converted has no blocks (its layers run on the file's fp32 values), while the types it
    reads as they are keep theirs."""
    from loom.model import loader

    path = write_gguf(build_tiny_model(TINY_SPECS["llama"]), tmp_path / "q.gguf", quant="Q5_0")
    assert load_model(str(path)).block_quant
    monkeypatch.setattr(loader, "converts_here", lambda: False)
    loaded = load_model(str(path))
    assert not loaded.block_quant and loaded.conversions == {}
    assert load_model(str(write_gguf(build_tiny_model(TINY_SPECS["llama"]),
                                     tmp_path / "q4.gguf", quant="Q4_1"))).block_quant


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc")
@pytest.mark.parametrize("quant", ["Q8_0", "Q5_0"])
def test_a_built_model_keeps_nothing_of_the_file_mapped(tmp_path, quant: str) -> None:
    """Once the model is built the GGUF is unmapped: the embedding blocks and the norms are
    copies (views kept the whole map, and every page loading touched, resident), and the
    model still answers from them."""
    path = write_gguf(build_tiny_model(TINY_SPECS["llama"]), tmp_path / "q.gguf", quant=quant)
    llm = LLM(model=str(path), kv_cache_memory="16MiB", dtype="float32")
    gc.collect()
    assert str(path) not in Path("/proc/self/smaps").read_text()
    assert llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0))[0] \
        .outputs[0].token_ids


@pytest.mark.unit
def test_f32_gguf_and_hf_folder_have_no_blocks(tmp_path) -> None:
    model = build_tiny_model(TINY_SPECS["llama"])
    assert load_model(str(write_gguf(model, tmp_path / "f.gguf"))).block_quant == {}
    assert load_model(str(save_hf_folder(model, tmp_path / "hf"))).block_quant == {}


class Recording(Mapping[str, torch.Tensor]):
    """The loader's weights, noting which ones the model asks for."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights, self.asked = weights, set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.asked.add(name)
        return self.weights[name]

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


@needs_kernel
@pytest.mark.integration
def test_weights_the_kernel_takes_are_never_made_in_fp32() -> None:
    """On the bundled Q4_1 model the native matmul takes every projection and the tied
    lm_head, and the embedding is looked up in its blocks, so only the norms are made in fp32;
    on the oneDNN path all are."""
    loaded = load_model(None)
    native, onednn = Recording(loaded.weights), Recording(loaded.weights)
    model = DecoderModel(loaded.arch, native, torch.float32, torch.device("cpu"),
                         block_quant=loaded.block_quant)
    assert native.asked == {n for n in loaded.weights if "norm" in n}
    ids = torch.tensor([0, 7, 7, loaded.arch.vocab_size - 1])
    torch.testing.assert_close(model.embed(ids), F.embedding(
        ids, loaded.block_quant["model.embed_tokens.weight"].dequantize()), rtol=0, atol=0)
    assert all(layer.qkv.weight is None for layer in model.layers)
    DecoderModel(loaded.arch, onednn, torch.float32, torch.device("cpu"), prepack=True)
    assert onednn.asked == set(loaded.weights)


@pytest.mark.integration
@needs_kernel
def test_engine_predicts_the_same_on_the_native_kernel(llm: LLM) -> None:
    """The bundled Q4_1 model, prefills and decode steps on the kernel against the same engine
    with every matmul on oneDNN: same greedy tokens; logprobs within fp32 noise on the fp32
    path, within what int16-precision activations cost on the int8 path (decode steps; the
    bound is about twice the largest teacher-forced difference
    benchmarks/kernels/native_accuracy.py has measured on any host: docs/benchmark-log.md,
    "Activations as two int8 parts")."""
    assert llm.engine.runner.model.layers[0].qkv.panels is not None  # auto picks native
    assert llm.engine.runner.model.lm_head.panels is not None  # Q8_0 embedding
    onednn = LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="float32",
                 linear_backend="onednn")
    assert onednn.engine.runner.model.layers[0].qkv.panels is None
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    for a, b in zip(llm.generate(prompts, params), onednn.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x.logprob - y.logprob) < 2e-2


@pytest.mark.integration
def test_native_backend_refuses_weights_without_blocks(tmp_path) -> None:
    folder = save_hf_folder(build_tiny_model(TINY_SPECS["llama"]), tmp_path / "hf")
    with pytest.raises(ValueError, match="linear_backend 'native' needs a GGUF"):
        LLM(model=str(folder), kv_cache_memory="16MiB", dtype="float32", linear_backend="native")
    with pytest.raises(ValueError, match="linear_backend 'native' needs a CPU device, float32"):
        LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="bfloat16",
            linear_backend="native")
