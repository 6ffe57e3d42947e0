"""Shared fixtures."""

from __future__ import annotations

import pytest

# loom first, before anything that loads torch: importing loom sets OpenMP's passive wait
# policy, which torch reads once when it loads (spinning OpenMP threads slow every test on a
# busy 2-core machine many times over).
from loom import LLM


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for the module that asks (restored after it): the tiny-model and
    transformers comparisons are too small to gain from two."""
    from model_fixtures import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The bundled SmolLM2-135M-Instruct with a small KV cache, in float32 (auto's on a CPU,
    named for any device): bf16 is not batch-invariant, and these tests compare greedy tokens
    across batch compositions and schedulers. (float32 is, except across the native matmul's
    switch between its int8 and fp32 paths, which moves logprobs by less than the margins
    of these prompts' greedy choices.)"""
    return LLM(kv_cache_memory="256MiB", max_model_len=2048, dtype="float32")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test is `unit` or `integration` (pyproject's markers), one of them, so that
    `-m unit` and `-m integration` split the whole suite: a test with neither or both stops
    the run."""
    wrong = [f"{item.nodeid} ({' and '.join(kinds) or 'neither'})" for item in items
             if len(kinds := sorted({"unit", "integration"}
                                    & {m.name for m in item.iter_markers()})) != 1]
    if wrong:
        raise pytest.UsageError("each test is marked unit or integration (pyproject.toml's "
                                "markers), not: " + ", ".join(wrong))
