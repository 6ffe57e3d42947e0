"""The text to score and its chunks, as llama-perplexity cuts them.

The whole text is tokenized once; chunk i is the `context` tokens from i * stride (stride =
context by default: non-overlapping chunks, llama.cpp's way). Only the second half of each
chunk is scored: the logits at positions context // 2 .. context - 2 predict tokens
context // 2 + 1 .. context - 1, so every scored token sees at least half a chunk of context
(llama.cpp's `first = n_ctx / 2`). With a model that adds a BOS token, each chunk's first token
is replaced by BOS, as llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUNDLED_TEXT = "kjv-genesis-exodus.txt"


def bundled_text() -> Path:
    """The public-domain text that ships with loom (data/README.md names its source)."""
    return Path(str(resources.files("loom.eval") / "data" / BUNDLED_TEXT))


def read_text(path: str | Path | None) -> str:
    """The text of `path` (the bundled text when None); a missing, unreadable or empty file
    is a ValueError naming it."""
    path = bundled_text() if path is None else Path(path)
    if not path.is_file():
        raise ValueError(f"--text {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--text {path}: cannot read it as UTF-8 text ({e})") from None
    if not text.strip():
        raise ValueError(f"--text {path}: the file is empty")
    return text


@dataclass(frozen=True)
class Chunk:
    """One window of the text: its token ids and the first of them that is scored."""

    index: int
    token_ids: list[int]
    first_scored: int  # index into token_ids of the first token whose log-probability counts

    @property
    def targets(self) -> list[int]:
        return self.token_ids[self.first_scored:]


def chunks(token_ids: list[int], context: int, stride: int | None = None,
           max_chunks: int | None = None, bos_token_id: int | None = None) -> list[Chunk]:
    """The chunks of `token_ids` (see the module docstring); a text shorter than one chunk is
    a ValueError that says how many tokens it has and needs."""
    if context < 4:
        raise ValueError(f"--context must be >= 4 tokens, got {context}")
    stride = context if stride is None else stride
    if not 1 <= stride <= context:
        raise ValueError(f"--stride must be in [1, --context ({context})], got {stride}")
    if len(token_ids) < context:
        raise ValueError(f"the text is {len(token_ids)} tokens, shorter than one chunk of "
                         f"--context {context}; give a longer text or a smaller --context")
    count = 1 + (len(token_ids) - context) // stride
    if max_chunks is not None:
        count = min(count, max_chunks)
    out = []
    for i in range(count):
        ids = token_ids[i * stride:i * stride + context]
        if bos_token_id is not None:
            ids = [bos_token_id, *ids[1:]]
        out.append(Chunk(i, ids, context // 2 + 1))
    return out
