"""The fused add + RMSNorm and SiLU * up kernels (csrc/fused_ops.cpp) against torch's ops, and
the model on them against the model on torch's; and the model with its fused RoPE + KV write +
decode attention op (csrc/paged_attention.cpp) against the model with torch's attention path."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from model_fixtures import (
    TINY_SPECS,
    Chunk,
    build_tiny_model,
    make_runner,
    smollm_loaded,
    step_logits,
    write_gguf,
)

from loom.model.backends import Backends
from loom.model.decoder import DecoderModel
from loom.model.kernels import fused_ops, paged_attention_ops
from loom.model.linear import amx_fits, amx_tiles, bf16_slices, from_amx_tiles
from loom.model.loader import load_model
from loom.model.runner import ModelRunner

ops = fused_ops()
pytestmark = [pytest.mark.skipif(ops is None, reason="no C++ compiler for the fused kernels")]


@pytest.mark.unit
@pytest.mark.parametrize("rows", [0, 1, 5, 33, 300])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(rows: int, with_delta: bool) -> None:
    """Rows split over threads from 29 rows of 576 on (the grain): both sides of it."""
    gen = torch.Generator().manual_seed(rows)
    hidden, delta = (torch.randn(rows, 576, generator=gen) * 3 for _ in range(2))
    weight = torch.rand(576, generator=gen) + 0.5
    expected_hidden = hidden + delta if with_delta else hidden.clone()
    expected = F.rms_norm(expected_hidden, (576,), weight, 1e-5)
    out = ops.add_rms_norm(hidden, delta if with_delta else None, weight, 1e-5)
    torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=0)  # added in place
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize("rows", [0, 1, 4, 11, 64])
def test_silu_mul_matches_torch(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.unit
def test_silu_mul_is_accurate_over_the_whole_float_range() -> None:
    """Past |x| = 88 e^-x over- or underflows a float; -ffast-math assumes it never does."""
    x = torch.cat([torch.linspace(-200, 200, 400_001), torch.tensor([-1e30, 1e30, 0.0])])
    out = ops.silu_mul(torch.cat([x, torch.ones_like(x)]).view(1, -1))  # gate, then up
    exact = F.silu(x.double())
    assert torch.isfinite(out).all()
    assert ((out.double() - exact).abs() <= 1e-6 * exact.abs() + 1e-30).all()


@pytest.mark.unit
def test_bf16_cast_is_torchs_bit_for_bit() -> None:
    """Rounding to nearest even (ties included), at sizes below and above one task's grain."""
    x = torch.randn(70, 4096) * 100
    x[0, :6] = torch.tensor([3e38, -3e38, 1e-40, 0.0, -0.0, 1.0 + 2.0**-8])  # last: a tie
    for rows in (1, 70):
        part = x[:rows].contiguous()
        assert torch.equal(ops.to_bf16(part).view(torch.int16), part.bfloat16().view(torch.int16))


@pytest.mark.unit
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_bf16_linear_is_a_bf16_matmul_on_column_slices(threads: int) -> None:
    """bf16_linear against F.linear on x and W in bf16, product widened, bias added in fp32:
    within one bf16 rounding of each sum (a slice's blocking may order them differently), at
    decode and prefill row counts, on dense slices and oneDNN-packed ones, with output widths
    that leave a narrow last slice or fit one, on one thread and on slices run by helpers."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, cols in ((0, 48), (1, 200), (17, 200), (64, 1000), (300, 48)):
            x, weight = torch.randn(rows, 96) * 3, torch.randn(cols, 96).bfloat16()
            bias = torch.randn(cols)
            product = F.linear(x.bfloat16(), weight).float()
            packed = bf16_slices(weight, threads)
            dense = [w.to_dense() if w.is_mkldnn else w for w in packed]
            assert torch.equal(torch.cat(dense), weight)
            assert len(packed) == (1 if cols == 48 else min(threads, -(-cols // 64)))
            for slices, b in ((packed, bias), (dense, None), ([weight], bias)):
                out = ops.bf16_linear(x, slices, b)
                assert out.shape == (rows, cols) and out.dtype == torch.float32
                got = out - bias if b is not None else out
                one_rounding = product.abs() * 2.0**-7 + 1e-6
                assert ((got - product).abs() <= one_rounding).all()
                if rows:  # and most sums are not rounded apart at all
                    assert (got == product).float().mean() > 0.95
    finally:
        torch.set_num_threads(before)
    x, weight = torch.randn(4, 96), torch.randn(8, 96).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.bf16_linear(x, [weight.float()], None)
    with pytest.raises(RuntimeError, match="in"):
        ops.bf16_linear(torch.randn(4, 64), [weight], None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.bf16_linear(x, [weight, weight], torch.randn(8))
    with pytest.raises(RuntimeError, match="empty"):
        ops.bf16_linear(x, [], None)


needs_amx = pytest.mark.skipif(ops is None or not ops.amx_available(),
                               reason="no AMX tiles on this CPU (or this build)")


@pytest.mark.unit
def test_amx_tiles_round_trip() -> None:
    """The AMX layout holds the weight's every element once, and puts input pairs together:
    tile row r of a block holds inputs 2r and 2r + 1 of each of its 16 channels."""
    weight = torch.randn(96, 64).bfloat16()
    tiles = amx_tiles(weight)
    assert tiles.shape == (3, 2, 2, 16, 16, 2)
    assert torch.equal(from_amx_tiles(tiles), weight)
    # block 1 (channels 32-63), step 1 (inputs 32-63), channels 48-63, pair row 3, channel 5
    assert torch.equal(tiles[1, 1, 1, 3, 5], weight[32 + 16 + 5, 32 + 6:32 + 8])
    assert amx_fits((96, 64)) and not amx_fits((96, 48)) and not amx_fits((40, 64))


@pytest.mark.unit
@needs_amx
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_amx_bf16_linear_is_a_bf16_matmul(threads: int) -> None:
    check_amx_bf16_linear(ops, threads)


def check_amx_bf16_linear(kernels: ModuleType, threads: int) -> None:
    """amx_bf16_linear of `kernels` against F.linear on x and W in bf16, product widened, bias
    added in fp32, as bf16_linear: within one bf16 rounding of each sum (the tiles sum in
    another order), mostly equal over all the calls (one row of 32 sums may hold two rounded
    apart); at row counts below, at and between tiles of 16 rows and pairs of them, over
    several panels of rows (and x rounded to bf16 on the pool), on one block of channels and
    on many, run by one thread or by helpers; bad arguments refused."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    equal, total = 0, 0
    try:
        for rows, cols, inputs in ((1, 32, 32), (5, 96, 64), (16, 64, 96), (17, 160, 96),
                                   (32, 64, 576), (33, 96, 64), (64, 256, 128),
                                   (300, 96, 64), (600, 64, 128), (0, 64, 32)):
            x, weight = torch.randn(rows, inputs) * 3, torch.randn(cols, inputs).bfloat16()
            bias = torch.randn(cols)
            product = F.linear(x.bfloat16(), weight).float()
            for b in (bias, None):
                out = kernels.amx_bf16_linear(x, amx_tiles(weight), b)
                assert out.shape == (rows, cols) and out.dtype == torch.float32
                got = out - bias if b is not None else out
                one_rounding = product.abs() * 2.0**-7 + 1e-6
                assert ((got - product).abs() <= one_rounding).all()
                equal, total = equal + int((got == product).sum()), total + got.numel()
        assert equal > 0.95 * total
    finally:
        torch.set_num_threads(before)
    x, tiles = torch.randn(4, 64), amx_tiles(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="tiles"):
        kernels.amx_bf16_linear(torch.randn(4, 96), tiles, None)
    with pytest.raises(RuntimeError, match="tiles"):
        kernels.amx_bf16_linear(x, tiles.float(), None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.amx_bf16_linear(x, tiles, torch.randn(64))
    with pytest.raises(RuntimeError, match="x must"):
        kernels.amx_bf16_linear(x.bfloat16(), tiles, None)


@pytest.mark.unit
def test_bad_inputs_are_refused() -> None:
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32"):
        ops.add_rms_norm(torch.ones(2, 8, dtype=torch.float64), None, weight, 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.add_rms_norm(torch.ones(8, 2).t(), None, weight, 1e-5)
    with pytest.raises(RuntimeError, match="shape"):
        ops.add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), weight, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.add_rms_norm(torch.ones(2, 8), None, torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_mul(torch.ones(2, 7))


@pytest.mark.integration
def test_model_logits_match_with_and_without_the_fused_kernels(tmp_path) -> None:
    """A prefill of two requests, then a decode step of both, on the tiny Llama."""
    loaded = load_model(str(write_gguf(build_tiny_model(TINY_SPECS["llama"]),
                                       tmp_path / "t.gguf")))
    runners = [make_runner(loaded, fused=fused) for fused in (False, True)]
    prefill = [Chunk("a", [5, 9, 2, 7, 1, 3], 0, [3, 1]), Chunk("b", [4, 4, 8], 0, [0])]
    decode = [Chunk("a", [6], 6, [3, 1, 2]), Chunk("b", [2], 3, [0])]
    for step in (prefill, decode):
        unfused, fused = (step_logits(runner, step) for runner in runners)
        for request_id in unfused:
            torch.testing.assert_close(fused[request_id], unfused[request_id], rtol=1e-4,
                                       atol=1e-4)


@pytest.mark.integration
@pytest.mark.skipif(paged_attention_ops() is None, reason="no C++ compiler for the kernels")
@pytest.mark.parametrize("kv_dtype,atol", [# c's chunk after its cached prefix attends per
                                           # token on the native path, by SDPA on the torch
                                           # one: fp32 sums in two orders, 30 layers deep
                                           # (1.2e-4 on logits of tens measured)
                                           (torch.float32, 2e-4),
                                           # the paths' RoPE differ in the last bit, which
                                           # sometimes rounds a key to the next fp16 value
                                           (torch.float16, 1e-2)])
def test_bundled_model_logits_match_with_and_without_the_fused_attention_op(kv_dtype,
                                                                            atol) -> None:
    """SmolLM2 (9 query heads over 3 kv heads of 64, in the native kernel's shapes), one model
    behind two runners that differ only in the attention path: prefills over several blocks,
    then steps mixing decodes with a chunk after a cached prefix that starts mid-block, and a
    decode whose position starts a new block; over an fp32 KV cache and an fp16 one. fp32
    matmuls: the native ones quantize activations to int8, which turns rounding-level
    differences into whole steps of a code."""
    loaded, cpu = smollm_loaded(), torch.device("cpu")
    model = DecoderModel(loaded.arch, loaded.weights, torch.float32, cpu, fused_ops=ops)
    runners = []
    for native in (False, True):
        backends = Backends(device=cpu, dtype=torch.float32, kv_dtype=kv_dtype, num_threads=0,
                            native_decode=native, linear="torch", fused_ops=ops)
        runners.append(ModelRunner(model, backends, block_size=16))
        runners[-1].initialize_kv_cache(16)
    steps = [
        [Chunk("a", list(range(100, 132)), 0, [0, 1, 2]), Chunk("b", [7, 8, 9, 10, 11], 0, [3]),
         Chunk("c", list(range(500, 518)), 0, [4, 5])],
        [Chunk("a", [40], 32, [0, 1, 2]), Chunk("b", [12], 5, [3]),
         Chunk("c", list(range(600, 612)), 18, [4, 5])],
        [Chunk("a", [41], 33, [0, 1, 2]), Chunk("c", [13], 30, [4, 5])],
    ]
    for step in steps:
        expected, actual = (step_logits(runner, step) for runner in runners)
        for request_id in expected:
            torch.testing.assert_close(actual[request_id], expected[request_id], rtol=1e-5,
                                       atol=atol)
