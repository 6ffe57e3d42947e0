"""The native matmul on a GGUF's block-quantized weights (csrc/block_quant_linear.cpp): the
loader must hand over the file's own codes, scales and offsets, and the kernel must compute
what F.linear computes on the dequantized weights, at every batch size it is given."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_fixtures import TINY_SPECS, build_tiny_model, save_hf_folder, write_gguf

from loom import LLM, SamplingParams
from loom.model.kernels import block_quant_linear_ops
from loom.model.linear import Linear, to_panels
from loom.model.llama import LlamaModel
from loom.model.loader import (
    _hf_name,
    _permuted_heads,
    _unpermute_rope,
    load_model,
)
from loom.model.weights import BlockQuantWeight

ops = block_quant_linear_ops()
needs_kernel = pytest.mark.skipif(ops is None or not ops.supported(),
                                  reason="no C++ compiler or no AVX2/FMA")


def random_block_quant(out_features: int, in_features: int, seed: int) -> BlockQuantWeight:
    """Q4_1-like: codes 0..15, a positive scale and a negative offset per block of 32."""
    gen = torch.Generator().manual_seed(seed)
    blocks = (out_features, in_features // 32)
    return BlockQuantWeight(
        codes=torch.randint(0, 16, (out_features, in_features), generator=gen,
                            dtype=torch.int8),
        scale=torch.rand(blocks, generator=gen) * 0.02 + 0.001,
        offset=-torch.rand(blocks, generator=gen) * 0.15)


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 24, 40])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 64), (48, 96)])
def test_kernel_matches_f_linear_on_dequantized_weights(rows: int, out_features: int,
                                                        in_features: int) -> None:
    """Up to 6 rows the kernel decodes in registers, past that into an fp32 panel under a
    6-row tile with a remainder: every path, with and without bias."""
    bq = random_block_quant(out_features, in_features, seed=rows)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for b in (None, bias):
        out = ops.block_quant_linear(x, *to_panels(bq), b)
        torch.testing.assert_close(out, F.linear(x, bq.dequantize(), b), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_takes_strided_rows_and_refuses_bad_shapes() -> None:
    bq = random_block_quant(16, 64, seed=1)
    panels = to_panels(bq)
    for rows in (5, 9):
        strided = torch.randn(64, rows).t()
        torch.testing.assert_close(ops.block_quant_linear(strided, *panels, None),
                                   F.linear(strided, bq.dequantize()), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="panels"):
        ops.block_quant_linear(torch.randn(2, 64), bq.codes, *panels[1:], None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.block_quant_linear(torch.randn(2, 48), panels[0][:, :48].contiguous(),
                               *panels[1:], None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.block_quant_linear(torch.randn(2, 64).double(), *panels, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.block_quant_linear(torch.randn(2, 64), *panels, torch.randn(8))


@needs_kernel
def test_linear_uses_the_kernel_at_every_batch_size() -> None:
    """A block-quantized form that deliberately differs from the fp32 weight shows which path
    each call took; the fp32 weight is not kept. Channels that do not fill whole panels, or
    no compiled kernel, leave the layer on the fp32 weight."""
    bq = random_block_quant(32, 64, seed=2)
    other = torch.randn(32, 64)
    linear = Linear(other, None, prepack=False, block_quant=bq, block_quant_ops=ops)
    assert linear.weight is None
    for rows in (1, 6, 7, 300):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x), F.linear(x, bq.dequantize()), rtol=1e-5,
                                   atol=1e-5)
    x3 = torch.randn(2, 3, 64)
    torch.testing.assert_close(linear(x3), F.linear(x3, bq.dequantize()), rtol=1e-5, atol=1e-5)
    assert Linear(other, None, block_quant=bq, block_quant_ops=None).panels is None
    odd = random_block_quant(24, 64, seed=3)
    fallback = Linear(other[:24], None, block_quant=odd, block_quant_ops=ops)
    assert fallback.panels is None
    x = torch.randn(4, 64)
    torch.testing.assert_close(fallback(x), F.linear(x, other[:24]))


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
def test_loader_keeps_the_files_own_blocks(tmp_path, quant: str) -> None:
    """codes * scale + offset is bit for bit what gguf's own reader and dequantize give, q/k
    rows un-permuted; the loader's fp32 weights are those values."""
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
        assert bq.codes.dtype == torch.int8 and bq.scale.dtype == torch.float32
        np.testing.assert_array_equal(bq.dequantize().numpy(), expected)
        np.testing.assert_array_equal(loaded.weights[name].numpy(), expected)


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
    lm_head, so only the embedding and the norms are dequantized; on the oneDNN path all are."""
    loaded = load_model(None)
    native, onednn = Recording(loaded.weights), Recording(loaded.weights)
    model = LlamaModel(loaded.arch, native, torch.float32, torch.device("cpu"),
                       block_quant=loaded.block_quant)
    assert native.asked == {n for n in loaded.weights if "norm" in n or "embed" in n}
    assert all(layer.qkv.weight is None for layer in model.layers)
    LlamaModel(loaded.arch, onednn, torch.float32, torch.device("cpu"), prepack=True)
    assert onednn.asked == set(loaded.weights)


@pytest.mark.integration
@needs_kernel
def test_engine_predicts_the_same_on_the_native_kernel(llm: LLM) -> None:
    """The bundled Q4_1 model, prefills and decode steps on the kernel against the same engine
    with every matmul on oneDNN: same greedy tokens, logprobs within fp32 noise."""
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
            assert abs(x.logprob - y.logprob) < 1e-3


@pytest.mark.integration
def test_native_backend_refuses_weights_without_blocks(tmp_path) -> None:
    folder = save_hf_folder(build_tiny_model(TINY_SPECS["llama"]), tmp_path / "hf")
    with pytest.raises(ValueError, match="linear_backend 'native' needs a GGUF"):
        LLM(model=str(folder), kv_cache_memory="16MiB", linear_backend="native")
    with pytest.raises(ValueError, match="linear_backend 'native' needs a CPU device, float32"):
        LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="bfloat16",
            linear_backend="native")
