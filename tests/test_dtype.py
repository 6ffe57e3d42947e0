"""bf16, the default dtype on CPUs with native bf16 instructions, against float32: the same
model must make (almost) the same predictions. benchmarks/dtype_accuracy.py measures this at
length; here one passage, teacher-forced, guards against a broken bf16 path."""

from __future__ import annotations

import pytest
import torch

from loom import LLM, SamplingParams
from loom.host import has_native_bf16

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


def test_auto_dtype_is_bf16_exactly_where_the_cpu_has_it(llm: LLM) -> None:
    auto = LLM(kv_cache_memory="64MiB", max_model_len=1024)
    expected = torch.bfloat16 if has_native_bf16() else torch.float32
    assert auto.engine.runner.backends.dtype == expected
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
