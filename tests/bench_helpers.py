"""What several `loom bench` test files need: a small trace file on disk, the bundled
model's prompt synthesiser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.workload.tokens import PromptSynth, load_tokenizer


def bundled_synth() -> PromptSynth:
    """The bundled model's PromptSynth, or a skip when that optional package is absent."""
    try:
        return PromptSynth(load_tokenizer(None))
    except Exception as e:
        pytest.skip(f"bundled model tokenizer unavailable: {e}")


def write_trace_file(path: Path, prompts: list[str], max_tokens: int,
                     classes: list[str]) -> Path:
    """A JSONL trace of one request per prompt, the classes given in turn."""
    path.write_text("".join(
        json.dumps({"prompt": p, "max_tokens": max_tokens, "class": classes[i % len(classes)]})
        + "\n" for i, p in enumerate(prompts)))
    return path
