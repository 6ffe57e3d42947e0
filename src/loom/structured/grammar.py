"""A request's constraint as an llguidance grammar, checked once per distinct spec.

`grammar_for` prepares the spec (schema.py: bounds, approximations, ASCII `\\d`), turns it into
an llguidance grammar and compiles it once against a vocabulary of the 256 bytes, which takes
no model tokenizer and costs what the real compile costs. That compile finds what llguidance
refuses, and its first mask finds a language with no word at all (`{"$ref": "#"}`, a rule that
only refers to itself): an answer that could only be empty. Results are cached by (kind, spec).

The compile is native code that may take long or, on a grammar nested deep enough, overflow
its stack: the server runs this check in a child process (checker.py) and the engine on
threads with a large stack (manager.py). Whether a choice can be written at all depends on the
model's vocabulary, so that check (`check_writable`) takes the tokenizer.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any

from loom.sampling import SamplingParamsError, StructuredOutputsParams
from loom.structured.schema import ascii_digits, prepare_schema

logger = logging.getLogger(__name__)

# JSON as json.dumps writes it: a small model given free whitespace can wander into newlines
# until it runs out of tokens, and the output would not parse.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 512
_MAX_REASON_CHARS = 300  # of the grammar engine's message, in an error a client reads
_ENGINE_FAULT = "the grammar engine failed on it"


class StructuredOutputsError(SamplingParamsError):
    """A constraint that cannot compile; `field` is "structured_outputs" and the reason says
    which kind and why."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__("structured_outputs", f"{kind}: {reason}")
        self.kind, self.detail = kind, reason


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params`; raises StructuredOutputsError if it cannot
    compile or allows no answer."""
    return _checked_grammar(*params.key)


@lru_cache(maxsize=_CACHE_SIZE)
def _checked_grammar(kind: str, spec: str) -> str:
    import llguidance
    import llguidance.numpy as lln

    try:
        grammar = _to_grammar(kind, spec)
    except ValueError as e:
        raise StructuredOutputsError(kind, client_reason(str(e))) from e
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if not matcher.is_error():
        lln.fill_next_token_bitmask(matcher, lln.allocate_token_bitmask(1, _BYTES + 1), 0)
        if matcher.is_stopped() and not matcher.is_accepting():
            raise StructuredOutputsError(kind, "allows no answer at all (nothing can start it: "
                                         "a rule or $ref that only refers to itself?)")
    if matcher.is_error():
        raise StructuredOutputsError(kind, client_reason(matcher.get_error()))
    return grammar


def client_reason(message: str) -> str:
    """The grammar engine's message as a client may read it: on one line, cut short; a
    panic of the native code (its text and backtrace say nothing useful to a client) is
    logged here and named only as a failure."""
    if "panic" in message.lower() or "backtrace" in message.lower():
        logger.warning("llguidance failed on a client's grammar: %s", message[:2000])
        return _ENGINE_FAULT
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    text = text or "cannot be compiled"
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."


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
        schema = prepare_schema(json.loads(spec), known_format)
        return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(ascii_digits(spec))
    if kind == "choice":
        choices = json.loads(spec)
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF as llama.cpp writes it
    raise ValueError(f"unknown kind {kind!r}")


@lru_cache(maxsize=64)
def known_format(name: str) -> bool:
    """Whether llguidance enforces this JSON-schema string `format` (asked of llguidance
    itself, so a newer version's formats are used as they come)."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "string", "format": name}, defaults=JSON_OPTIONS)
    return not llguidance.LLMatcher.validate_grammar(grammar)


_BYTES = 256


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, for compiling without the model's."""

    eos_token_id = _BYTES
    bos_token_id = None
    tokens = [bytes([b]) for b in range(_BYTES)] + [b"<end>"]
    special_token_ids = [_BYTES]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@lru_cache(maxsize=1)
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
