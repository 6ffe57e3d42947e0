"""bf16 against float32: the same model must make (almost) the same predictions, as a bfloat16
model and as a float32 one whose wide matmuls run in bf16 (`batched_matmul bfloat16`; auto
keeps float32 matmuls: tests/test_batch_invariant.py guards their quality bound).
benchmarks/kernels/dtype_accuracy.py measures this at length; here one passage,
teacher-forced, guards against a broken bf16 path.
And which dtype and matmuls auto picks where."""

from __future__ import annotations

import pytest
import torch

from loom import LLM, SamplingParams, host
from loom.config import CacheConfig, ModelConfig
from loom.model import backends
from loom.model.backends import (
    PER_TOKEN_PREFILL_MAX_POSITIONS,
    PER_TOKEN_PREFILL_MAX_POSITIONS_BF16,
    resolve_backends,
)
from loom.model.linear import BF16_ABOVE_ROWS, BF16_ABOVE_ROWS_AMX
from loom.model.loader import load_model

pytestmark = pytest.mark.integration

PASSAGE = (
    "The river rises in the hills above the town and runs south for forty miles before it "
    "reaches the sea. In spring the snow melts and the water climbs over its banks, so the "
    "farmers plant late and build their houses on the higher ground. Every autumn the town "
    "holds a fair by the old stone bridge, where traders sell apples, wool and honey."
)


def prompt_predictions(llm: LLM) -> tuple[list[int], list[float]]:
    """Top-1 prediction and the logprob of the actual next token, at every prompt position."""
    out = llm.generate(PASSAGE, SamplingParams(max_tokens=1, temperature=0,
                                               prompt_logprobs=1))[0]
    entries = out.prompt_logprobs[1:]
    return [e.top[0][0] for e in entries], [e.logprob for e in entries]


def test_auto_runs_the_bundled_gguf_in_float32(llm: LLM) -> None:
    """The bundled GGUF: float32 (on the native kernel where it builds), its wide calls too (no
    bf16 copies)."""
    auto = LLM(kv_cache_memory="64MiB", max_model_len=1024)
    backends = auto.engine.runner.backends
    assert backends.dtype == torch.float32
    assert not backends.batched_bf16
    assert not auto.engine.runner.model.lm_head.has_bf16_copy
    answer = auto.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].text
    assert "Paris" in answer


def test_bf16_predicts_like_float32(llm: LLM) -> None:
    bf16 = LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="bfloat16")
    top_fp32, logprob_fp32 = prompt_predictions(llm)
    top_bf16, logprob_bf16 = prompt_predictions(bf16)
    agreement = sum(a == b for a, b in zip(top_fp32, top_bf16)) / len(top_fp32)
    drift = sum(abs(a - b) for a, b in zip(logprob_fp32, logprob_bf16)) / len(logprob_fp32)
    assert len(top_fp32) > 60
    assert agreement >= 0.9, f"top-1 agreement {agreement:.1%}"
    assert drift < 0.1, f"mean |logprob difference| {drift:.3f}"


@pytest.mark.parametrize(("native_bf16", "amx"), [(True, True), (True, False), (False, False)])
def test_auto_choices_on_each_cpu(monkeypatch, native_bf16: bool, amx: bool) -> None:
    """resolve_backends on each kind of CPU, for a model the native kernel takes (blocks) and
    one it cannot: the dtype, the wide matmuls (bf16 only when asked for) and from how many
    rows, and the error for bf16 matmuls without the kernel."""
    arch = load_model(None).arch
    monkeypatch.setattr(host, "has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(backends, "amx_kernel_runs", lambda: amx)  # AMX tiles granted
    monkeypatch.setattr(host, "has_amx", lambda: amx)
    probe = resolve_backends(ModelConfig(dtype="float32"), CacheConfig(), arch, True)
    if probe.linear != "native":
        pytest.skip("the native kernel does not build here")

    def resolve(has_blocks: bool = True, **model: str):
        return resolve_backends(ModelConfig(**model), CacheConfig(), arch, has_blocks)

    auto = resolve()
    assert (auto.dtype, auto.linear, auto.batched_bf16) == (torch.float32, "native", False)
    assert not auto.bf16_prefill_attention
    assert "bf16" not in auto.describe()
    assert auto.per_token_prefill_max_positions == PER_TOKEN_PREFILL_MAX_POSITIONS
    no_blocks = resolve(has_blocks=False)  # a Hugging Face folder: float32 too, on any CPU
    assert no_blocks.dtype == torch.float32
    assert not no_blocks.batched_bf16
    assert not resolve(dtype="float32").batched_bf16  # float32 asked for: float32 matmuls
    assert not resolve(batched_matmul="native").batched_bf16
    assert not resolve(batched_matmul="native").bf16_prefill_attention
    forced = resolve(dtype="float32", batched_matmul="bfloat16")
    above = BF16_ABOVE_ROWS_AMX if amx else BF16_ABOVE_ROWS
    assert forced.bf16_above_rows == above
    assert f"bf16 above {above} rows" in forced.describe()
    assert forced.bf16_prefill_attention == amx  # measured faster on AMX only
    assert ("long prefill attention bf16" in forced.describe()) == amx
    # against a bf16 SDPA short chunks stay per-token rows only up to a smaller bound
    assert forced.per_token_prefill_max_positions == (
        PER_TOKEN_PREFILL_MAX_POSITIONS_BF16 if amx else PER_TOKEN_PREFILL_MAX_POSITIONS)
    assert PER_TOKEN_PREFILL_MAX_POSITIONS_BF16 < PER_TOKEN_PREFILL_MAX_POSITIONS
    with pytest.raises(ValueError, match="batched_matmul 'bfloat16' applies to the native"):
        resolve(has_blocks=False, dtype="float32", batched_matmul="bfloat16")


def test_bf16_batched_matmuls_predict_like_float32(llm: LLM) -> None:
    """The passage's prefill is wider than 16 rows: every matmul of it on the bf16 copies."""
    mixed = LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="float32",
                batched_matmul="bfloat16")
    if not mixed.engine.runner.backends.batched_bf16:
        pytest.skip("the native kernel does not build here")
    top_fp32, logprob_fp32 = prompt_predictions(llm)
    top_mixed, logprob_mixed = prompt_predictions(mixed)
    agreement = sum(a == b for a, b in zip(top_fp32, top_mixed)) / len(top_fp32)
    drift = sum(abs(a - b) for a, b in zip(logprob_fp32, logprob_mixed)) / len(logprob_fp32)
    assert agreement >= 0.9, f"top-1 agreement {agreement:.1%}"
    assert drift < 0.1, f"mean |logprob difference| {drift:.3f}"
    assert logprob_mixed != logprob_fp32  # the bf16 path really ran


def test_kv_cache_is_float16_under_float32_on_cpu_and_holds_twice_the_tokens(llm: LLM) -> None:
    """auto picks an fp16 cache where the native decode kernel runs float32 (the session's
    llm), which then holds twice the blocks of an fp32 one in the same memory and predicts as
    it does: same greedy text, the same top-1 at every prompt position, logprobs within
    rounding."""
    backends = llm.engine.runner.backends
    if not backends.native_decode:
        pytest.skip("no C++ compiler: the torch path keeps the model's dtype")
    assert (backends.dtype, backends.kv_dtype) == (torch.float32, torch.float16)
    exact = LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="float32",
                kv_cache_dtype="float32")
    half = LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="float32")
    assert exact.engine.runner.backends.kv_dtype == torch.float32
    assert half.engine.num_kv_blocks == 2 * exact.engine.num_kv_blocks
    top_exact, logprob_exact = prompt_predictions(exact)
    top_half, logprob_half = prompt_predictions(half)
    assert top_half == top_exact
    assert max(abs(a - b) for a, b in zip(logprob_exact, logprob_half)) < 0.05
    params = SamplingParams(max_tokens=48, temperature=0)
    question = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    assert (half.chat(question, params)[0].outputs[0].token_ids
            == exact.chat(question, params)[0].outputs[0].token_ids)


def test_a_kv_cache_dtype_the_kernel_cannot_read_falls_back_or_is_refused() -> None:
    """bf16 K/V under float32 activations is no pair the native kernel reads: auto attention
    takes the torch path (which converts), and asking for the native kernel names why not."""
    torch_path = LLM(kv_cache_memory="16MiB", max_model_len=256, dtype="float32",
                     kv_cache_dtype="bfloat16")
    backends = torch_path.engine.runner.backends
    assert (backends.kv_dtype, backends.native_decode) == (torch.bfloat16, False)
    out = torch_path.generate("The capital of France is", SamplingParams(max_tokens=4,
                                                                         temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="attention_backend 'native'.*KV cache"):
        LLM(kv_cache_memory="16MiB", max_model_len=256, dtype="float32",
            kv_cache_dtype="bfloat16", attention_backend="native")
