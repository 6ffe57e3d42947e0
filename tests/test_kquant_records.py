"""Q4_K and Q6_K in the native matmul's own records (csrc/block_quant_linear.cpp,
requant.py): both of the kernel's paths on them against a float64 product with the file's
exact weights (gguf's dequantize of the same bytes), on random blocks whose scale products are
no fp16 values, on this host's build and on one without AVX-512 (so without VNNI); and a
Q4_K_M model (benchmarks/synthetic_gguf.py's, a tiny shape) on them against the same file run
on its dequantized fp32 weights."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from llama_cpp_tree import llama_cpp_tree
from test_block_quant import FP32, INT8, needs_kernel, ops, two_part_reference, two_part_x
from test_other_simd import _build
from test_requant import exact, random_blocks

from loom import LLM, SamplingParams, host
from loom.model.linear import Linear, to_panels
from loom.model.requant import native_blocks
from loom.model.weights import BlockQuantWeight

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: benchmarks.*
from benchmarks import synthetic_gguf  # noqa: E402 - the writer of model-shaped files

BITS_PER_WEIGHT = {"Q4_K": 4.625, "Q6_K": 6.625}  # in the records: the file's, and d's share


def k_quant(rows: int, cols: int, seed: int, kind: str = "Q4_K"
            ) -> tuple[BlockQuantWeight, torch.Tensor]:
    """Random blocks of `kind` as loading converts them, and gguf's float64 weights of them."""
    data = random_blocks(kind, rows, cols, seed=seed, fp16=(1e-4, 2e-3))
    return (native_blocks(kind, data, (rows, cols)),
            torch.from_numpy(exact(kind, data, cols)).double())


def int8_reference(x: torch.Tensor, bq: BlockQuantWeight) -> torch.Tensor:
    """What the int8 path computes: Q4_K's as test_block_quant's; Q6_K's is x's two-part
    quantized values times the exact weights (its codes less 32 on the quantized x)."""
    if bq.kind != "Q6_K":
        return two_part_reference(x, bq)
    return (two_part_x(x).view(x.shape) @ bq.dequantize().double().T).float()


def check_both_paths(kernel: ModuleType, kind: str, rows: int, out_features: int,
                     in_features: int) -> None:
    bq, weights = k_quant(out_features, in_features, seed=rows, kind=kind)
    assert torch.equal(bq.dequantize().double(), weights)
    panels = to_panels(bq, kernel)
    assert panels.numel() * 8 == out_features * in_features * BITS_PER_WEIGHT[kind]
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    x[:, 3] *= 30  # an outlier channel, as real activations have
    want = (x.double() @ weights.T).float()
    scale = want.abs().amax().item()
    torch.testing.assert_close(kernel.block_quant_linear(x, panels, None, FP32), want,
                               rtol=1e-5, atol=2e-6 * scale)
    torch.testing.assert_close(kernel.block_quant_linear(x, panels, None, INT8),
                               int8_reference(x, bq), rtol=1e-5, atol=3e-6 * scale)


@pytest.mark.unit
@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 24])
# (48, 768): three panel pairs and three super-blocks, neither a power of two
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 256), (48, 768)])
def test_both_paths_compute_with_the_files_weights(kind: str, rows: int, out_features: int,
                                                   in_features: int) -> None:
    """The fp32 path is the float64 product with gguf's weights to fp32 rounding, and the int8
    path the two-part reference on them: nothing rounds the file's scales on the way."""
    check_both_paths(ops, kind, rows, out_features, in_features)


@pytest.fixture(scope="module")
def avx2_ops() -> ModuleType:
    """The matmul built without AVX-512 (AVX2's products where this host has VNNI's)."""
    if host.simd_level() != "avx512":
        pytest.skip("this host's own build is the AVX2 one")
    return _build("loom_block_quant_linear_avx2", "block_quant_linear.cpp", ["-mno-avx512f"])


@pytest.mark.integration
@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_the_avx2_build_computes_with_the_files_weights(avx2_ops: ModuleType, kind: str) -> None:
    assert not avx2_ops.vnni()
    for rows in (1, 5, 7):
        check_both_paths(avx2_ops, kind, rows, 48, 768)


@pytest.mark.unit
@needs_kernel
def test_odd_widths_and_mixed_stacks_keep_their_weights() -> None:
    """A layer whose rows are no whole panel pair runs on the exact fp32 weights; a stack of
    Q4_K with another kind in one kind (BlockQuantWeight.cat, as a reordered stack takes it:
    the Q6_K part goes to Q8_0 there) rounds the Q4_K scales to fp16 and no further."""
    bq, weights = k_quant(40, 256, seed=3)
    assert not Linear.uses_panels(bq, ops)
    x = torch.randn(3, 256)
    layer = Linear(bq.dequantize(), block_quant=bq, block_quant_ops=ops)
    torch.testing.assert_close(layer(x), (x.double() @ weights.T).float(), rtol=1e-5,
                               atol=1e-5)
    other = native_blocks("Q6_K", random_blocks("Q6_K", 16, 256, seed=4), (16, 256))
    both = BlockQuantWeight.cat([bq, other])
    assert both.kind == "I8"
    moved = (both.dequantize()[:40].double() - weights).abs()
    bound = (15 * bq.scale.abs() + bq.offset.abs()).double().repeat_interleave(32, 1)
    assert (moved <= bound * 2.0 ** -11 * (1 + 1e-6)).all() and moved.amax() > 0
    assert torch.equal(both.dequantize()[40:], other.as_q8_0().dequantize())
    assert BlockQuantWeight.cat([other, other]).kind == "Q6_K"
    with pytest.raises(ValueError, match="Q4_K"):
        BlockQuantWeight.from_codes(bq.codes, bq.scale.half().float(),
                                    bq.offset.half().float(), kind="Q4_K")


@pytest.mark.unit
@needs_kernel
@pytest.mark.parametrize("rows", [1, 7])  # the int8 path and the fp32 one
def test_a_stack_of_kinds_runs_each_part_in_its_own_records(rows: int) -> None:
    """A fused qkv of Q4_K q, k and a Q6_K v keeps [q k] in Q4_K and v in Q6_K records (not
    one kind for all, I8's 9 bits a weight): its bytes are each part's own, and its output,
    bias and all, is each part's own matmul side by side, bit for bit."""
    q, k = (k_quant(32, 256, seed=s)[0] for s in (5, 6))
    v = native_blocks("Q6_K", random_blocks("Q6_K", 16, 256, seed=7), (16, 256))
    runs = BlockQuantWeight.runs([q, k, v])
    assert [(r.kind, r.shape[0]) for r in runs] == [("Q4_K", 64), ("Q6_K", 16)]
    bias, path = torch.randn(80), INT8 if rows == 1 else FP32
    layer = Linear(None, bias, block_quant=runs, block_quant_ops=ops,
                   int8_max_rows={4: path, 8: path})
    assert [t.shape[-1] for t in layer.panel_tensors()] == [148, 212]
    assert sum(t.numel() for t in layer.panel_tensors()) * 8 == 256 * (64 * 4.625 + 16 * 6.625)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    want = torch.cat([ops.block_quant_linear(x, to_panels(r, ops), b, path)
                      for r, b in zip(runs, bias.split([64, 16]), strict=True)], dim=1)
    assert torch.equal(layer(x), want)
    with pytest.raises(RuntimeError, match="one int8 row limit per part"):
        ops.block_quant_linear_parts(x, layer.panel_tensors(), None, [INT8])


@pytest.mark.integration
@needs_kernel
def test_a_q4_k_m_model_runs_as_its_dequantized_weights(tmp_path: Path) -> None:
    """A Q4_K_M Llama (Q4_K, with Q6_K in the output and some attn_v and ffn_down) on the
    native kernel's records, both kinds in their own, against the torch backend on gguf's fp32
    weights: the same greedy tokens, and log-probabilities of every prompt and output token
    within the int8 activations' few thousandths."""
    shutil.copy(llama_cpp_tree() / "models" / "ggml-vocab-llama-spm.gguf", tmp_path / "ref.gguf")
    shape = synthetic_gguf.Shape("llama", hidden=256, ffn=512, layers=2, heads=4, kv_heads=2,
                                 head_dim=64)
    synthetic_gguf.write(shape, str(tmp_path / "ref.gguf"), str(tmp_path / "m.gguf"),
                         q4_k_m=True)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, prompt_logprobs=0)
    prompt = [1, 306, 4966, 304, 1207, 263, 4086, 29892, 541, 372, 1063, 3578]
    runs = {}
    for backend in ("native", "torch"):
        llm = LLM(model=str(tmp_path / "m.gguf"), kv_cache_memory="16MiB", dtype="float32",
                  linear_backend=backend)
        if backend == "native":
            model = llm.engine.runner.model
            assert model.layers[0].gate_up.panels.shape[-1] == 148  # Q4_K records
            assert {layer.down.panels.shape[-1] for layer in model.layers} == {148, 212}
            # layer 1's v is Q6_K: its qkv holds [q k] and v each in their own records
            assert [t.shape[-1] for t in model.layers[1].qkv.panel_tensors()] == [148, 212]
        runs[backend] = llm.generate([prompt], params)[0]
    native, torch_run = runs["native"], runs["torch"]
    assert native.outputs[0].token_ids == torch_run.outputs[0].token_ids

    def logprobs(out) -> np.ndarray:
        prompt_part = [p.logprob for p in out.prompt_logprobs if p is not None]
        return np.array(prompt_part + [t.logprob for t in out.outputs[0].logprobs])

    assert len(logprobs(native)) == len(prompt) - 1 + 8
    np.testing.assert_allclose(logprobs(native), logprobs(torch_run), rtol=0, atol=2e-2)
