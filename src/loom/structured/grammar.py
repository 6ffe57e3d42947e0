"""A request's constraint as an llguidance grammar, checked once per distinct spec.

Checking needs no tokenizer and takes well under a millisecond for the usual schemas, so the
HTTP layer runs it before admitting a request (a 400 naming the problem, never a 500) and the
engine runs it again for offline callers; both hit the same cache. Whether a choice can be
written at all depends on the model's vocabulary, so that check takes the tokenizer.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from loom.sampling import SamplingParamsError, StructuredOutputsParams

# JSON as json.dumps writes it: a small model given free whitespace can wander into newlines
# until it runs out of tokens, and the output would not parse.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 512


class StructuredOutputsError(SamplingParamsError):
    """A constraint that cannot compile; `field` is "structured_outputs" and the reason says
    which kind and why."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__("structured_outputs", f"{kind}: {reason}")
        self.kind = kind


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params`; raises StructuredOutputsError if it cannot
    compile."""
    return _checked_grammar(*params.key)


@lru_cache(maxsize=_CACHE_SIZE)
def _checked_grammar(kind: str, spec: str) -> str:
    import llguidance

    try:
        grammar = _to_grammar(kind, spec)
    except ValueError as e:
        raise StructuredOutputsError(kind, str(e)) from e
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputsError(kind, error.strip())
    return grammar


def check_writable(params: StructuredOutputsParams, tokenizer: Any) -> None:
    """Raise StructuredOutputsError naming a choice this model's vocabulary cannot write: a
    byte-level vocabulary may lack a byte (SmolLM2's has no token for 0xF1, the first byte of
    U+40000), and the grammar engine would then force tokens it refuses a step later. Regexes,
    schemas and grammars that need such text fail when they reach it, with the same prefix."""
    kind, spec = params.key
    if kind != "choice":
        return
    for choice in json.loads(spec):
        if tokenizer.decode(tokenizer.encode(choice, add_special_tokens=False),
                            skip_special_tokens=False) != choice:
            raise StructuredOutputsError(
                kind, f"{choice!r} has characters this model's vocabulary cannot write")


def _to_grammar(kind: str, spec: str) -> str:
    import llguidance

    matcher = llguidance.LLMatcher
    if kind == "json":
        return matcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF as llama.cpp writes it
    raise ValueError(f"unknown kind {kind!r}")
