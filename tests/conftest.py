"""Shared fixtures. Building an engine over the bundled model costs seconds, mostly GGUF
dequantization, so the suite loads each model file once and shares the weights (engines only
read them)."""

from __future__ import annotations

import functools

import pytest

import loom.engine.core
from loom import LLM


@pytest.fixture(scope="session", autouse=True)
def _load_each_model_once():
    original = loom.engine.core.load_model
    loom.engine.core.load_model = functools.cache(original)
    yield
    loom.engine.core.load_model = original


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The bundled SmolLM2-135M-Instruct with a small KV cache, in float32: bf16 (the default
    on CPUs with native bf16) is not batch-invariant, and these tests compare greedy tokens
    across batch compositions and schedulers."""
    return LLM(kv_cache_memory="256MiB", max_model_len=2048, dtype="float32")
