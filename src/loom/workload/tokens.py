"""The target model's tokenizer without its weights, and prompt text of an exact token count.

Trace lengths are stated in the served model's tokens, so generating a trace needs that
model's tokenizer, but not its weights: reading only the GGUF metadata (or a Hugging Face
`tokenizer.json`) keeps `loom bench trace` free of torch and of dequantizing tensors.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from tokenizers import Tokenizer

# Whole lower-case words behind a space: each is its own pre-token in byte-level BPE
# (` ?\p{L}+`), so a string of them splits back into exactly those tokens.
_WORD = re.compile(r" [a-z]{3,12}")


def tokenizer_path(path: str | Path | None) -> Path:
    """The tokenizer to use; None means that of the model `loom serve` serves by default."""
    if path is None:
        from loom.model.arch import default_model_path

        return default_model_path()
    return Path(path)


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """A GGUF file, a Hugging Face folder or a tokenizer.json -> its `tokenizers.Tokenizer`."""
    path = tokenizer_path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"tokenizer {str(path)!r} does not exist")
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    if path.suffix == ".json":
        return Tokenizer.from_file(str(path))
    raise ValueError(f"{str(path)!r} is neither a .gguf file, a tokenizer.json nor a folder")


def _gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer in a GGUF file's metadata, without reading its tensors."""
    from loom.model.gguf_file import read_gguf
    from loom.model.gguf_vocab import backend_from_gguf

    return backend_from_gguf(read_gguf(path).metadata)


class PromptSynth:
    """Counts tokens and writes filler text of an exact token count for a tokenizer.

    Text is a run of whole-word vocabulary tokens (" the", " river", ...) that each encode to
    one token on their own; for byte-level BPE the concatenation then encodes to exactly one
    token per word. For other tokenizers the count is checked and corrected word by word.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = sorted(tokenizer.get_vocab().values())
        texts = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=True)
        candidates = sorted({t for t in texts if _WORD.fullmatch(t)})
        encoded = tokenizer.encode_batch(candidates, add_special_tokens=False)
        self.words = [w for w, e in zip(candidates, encoded) if len(e.ids) == 1]
        if len(self.words) < 100:
            raise ValueError("the tokenizer has too few whole-word tokens to synthesise prompts")

    def count(self, text: str) -> int:
        """Tokens of `text` as the server's tokenizer sees it, special tokens not counted."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, num_tokens: int, rng: random.Random, prefix: str = "") -> str:
        """Text that, appended to `prefix`, adds exactly `num_tokens` tokens (where the
        tokenizer allows; the caller records the measured count either way)."""
        words = [rng.choice(self.words) for _ in range(num_tokens)]
        target = self.count(prefix) + num_tokens
        for _ in range(4 * num_tokens + 8):
            have = self.count(prefix + "".join(words))
            if have == target:
                break
            if have > target and words:
                words.pop()
            else:
                words.append(rng.choice(self.words))
        return "".join(words)
