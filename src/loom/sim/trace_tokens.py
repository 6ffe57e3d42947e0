"""Whose tokens a simulated trace's lengths are. A trace's prompts are counted by the tokenizer
`loom simulate` is given, SmolLM2's (loom's bundled model) by default: replayed against another
model they are silently the wrong lengths, since another vocabulary splits the same text into
more or fewer tokens. So the simulated model's own tokenizer counts them where its GGUF or
Hugging Face folder is given, and otherwise a warning says by about what factor the lengths
may be off (measured per known model, models.json's `tokens_per_smollm2_token`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loom.plan.models import known_models
from loom.workload.trace import Trace

RATIO_HOW = "measured on loom's README and docs, benchmarks/planning/tokenizer_ratio.py"


@dataclass(frozen=True)
class TraceTokens:
    """The tokenizer to count prompt texts with (None: the bundled model's) and what the
    user should know about the lengths, if anything."""

    tokenizer: str | None
    warning: str | None = None


def trace_tokens(trace: Trace, model: str | None, tokenizer: str | None) -> TraceTokens:
    """An explicit --tokenizer wins; else the model's own, where it is a file or folder that
    has one; else SmolLM2's, with a warning when the model is another."""
    if tokenizer is not None:
        return TraceTokens(tokenizer, _length_only(trace, Path(tokenizer).name))
    if model is None:  # the bundled model: its tokenizer is the default's
        return TraceTokens(None)
    known = known_models().get(model.lower())
    if known is None:
        own = _own_tokenizer(Path(model))
        if own is not None:
            return TraceTokens(str(own), _length_only(trace, own.name))
        return TraceTokens(None, f"{model} has no tokenizer.json or GGUF vocabulary to count "
                                 "the trace with: lengths are SmolLM2's tokens; give "
                                 "--tokenizer with the model's tokenizer to count exactly")
    ratio = known.get("tokens_per_smollm2_token")
    factor = (f"{model}'s tokenizer counts about {ratio:.2f} tokens per SmolLM2 token for the "
              f"same text ({RATIO_HOW}), so prompts may be off by ~{abs(1 - ratio):.0%}"
              if ratio else f"{model}'s tokenizer splits text differently, by a factor not "
                            "measured")
    return TraceTokens(None, f"the trace's prompts are counted with SmolLM2's tokenizer, not "
                             f"{model}'s: {factor}; give --tokenizer with the model's GGUF or "
                             "tokenizer.json to count exactly")


def _own_tokenizer(path: Path) -> Path | None:
    """A GGUF (its vocabulary) or the tokenizer.json beside a config.json / in a folder."""
    if path.suffix == ".gguf" and path.is_file():
        return path
    folder = path.parent if path.name == "config.json" else path
    candidate = folder / "tokenizer.json"
    return folder if candidate.is_file() else None


def _length_only(trace: Trace, counting: str) -> str | None:
    """Records with only prompt_len keep the counts of whoever made the trace."""
    made_with = trace.header.get("tokenizer")
    bare = sum(r.prompt is None for r in trace.requests)
    if not bare or made_with in (None, counting):
        return None
    return (f"{bare} of the trace's requests give only prompt_len, counted by {made_with}'s "
            f"tokenizer, not {counting}'s: they are replayed as that many tokens")
