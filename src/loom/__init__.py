"""loom: a continuous-batching LLM inference engine and OpenAI-compatible server."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loom.version import __version__

if TYPE_CHECKING:
    from loom.entrypoints.llm import LLM
    from loom.outputs import CompletionOutput, RequestOutput
    from loom.sampling import SamplingParams

# Before anything loads torch: libgomp reads its wait policy only then (loom/threads.py: why).
from loom.threads import default_wait_policy as _default_wait_policy  # noqa: E402

_default_wait_policy()

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

# Public names -> the module that defines them. They are imported on first use, so that
# `import loom.bench` (an HTTP client) and `loom --help` never pull in torch.
_LAZY = {
    "LLM": "loom.entrypoints.llm",
    "SamplingParams": "loom.sampling",
    "RequestOutput": "loom.outputs",
    "CompletionOutput": "loom.outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'loom' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
