"""Where the tests find llama.cpp's tree (vocab-only GGUFs with their tokenizer tests, chat
templates, the HF -> GGUF converter): unpacked by scripts/llama_cpp_tree.sh, which
`scripts/setup.sh --test` runs, at $LOOM_LLAMA_CPP_TREE or .venv/llama.cpp."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_DEFAULT = Path(__file__).resolve().parent.parent / ".venv" / "llama.cpp"


def llama_cpp_tree() -> Path:
    """The unpacked tree; the calling test fails (not skips) without it: the README's test
    command unpacks it, so its absence is a set-up defect, not an optional extra."""
    tree = Path(os.environ.get("LOOM_LLAMA_CPP_TREE") or _DEFAULT)
    if not (tree / "VERSION").exists():
        pytest.fail(f"llama.cpp's tree is not at {tree}: run bash scripts/llama_cpp_tree.sh "
                    "(scripts/setup.sh --test does)")
    return tree
