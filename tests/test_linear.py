"""Projection matmuls on weights prepacked for oneDNN (model/linear.py) must compute what
F.linear computes on the plain weights, at every batch size a step can have."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom import LLM, SamplingParams
from loom.model.linear import Linear, onednn_prepack_supported

needs_onednn = pytest.mark.skipif(
    not onednn_prepack_supported(torch.device("cpu"), torch.float32),
    reason="torch built without oneDNN")


@pytest.mark.unit
@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)
    packed = Linear(weight, bias, prepack=True)
    assert packed.prepacked and packed.weight.is_mkldnn
    assert (packed.in_features, packed.out_features, packed.num_params) == (80, 96, 80 * 96)
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.unit
@needs_onednn
def test_prepacked_linear_takes_strided_and_batched_inputs() -> None:
    weight = torch.randn(48, 32)
    packed = Linear(weight, prepack=True)
    strided = torch.randn(32, 10).t()  # [10, 32], not contiguous
    batched = torch.randn(3, 4, 32)
    torch.testing.assert_close(packed(strided), F.linear(strided, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(batched), F.linear(batched, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.integration
@needs_onednn
def test_engine_predicts_the_same_with_prepacked_weights() -> None:
    """Teacher-forced over a passage: the same top-1 token and logprobs within fp32 noise (an
    fp32 KV cache too: an fp16 one rounds some keys to the next value on one side only)."""
    packed, plain = (LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="float32",
                         kv_cache_dtype="float32", linear_backend=backend)
                     for backend in ("onednn", "torch"))
    assert packed.engine.runner.model.layers[0].qkv.prepacked
    assert not plain.engine.runner.model.layers[0].qkv.prepacked
    passage = ("Every autumn the town holds a fair by the old stone bridge, where traders "
               "sell apples, wool and honey, and children race paper boats under the arches.")
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1, logprobs=1)
    packed_out, plain_out = (m.generate(passage, params)[0] for m in (packed, plain))
    assert packed_out.outputs[0].token_ids == plain_out.outputs[0].token_ids
    for a, b in zip(packed_out.prompt_logprobs[1:], plain_out.prompt_logprobs[1:]):
        assert a.top[0][0] == b.top[0][0]
        assert abs(a.logprob - b.logprob) < 1e-3


@pytest.mark.integration
def test_onednn_backend_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="linear_backend 'onednn' needs"):
        LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="bfloat16",
            linear_backend="onednn")
