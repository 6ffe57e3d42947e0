"""Constraints that could stall or crash the server, and the keywords pydantic emits: size and
nesting refused before any parser, an empty language refused, the check in child processes
bounded in time and fair between clients, schema bounds and approximations, ASCII `\\d`."""

from __future__ import annotations

import asyncio
import json

import pytest

from loom.sampling import SamplingParamsError, StructuredOutputsParams
from loom.structured.checker import GrammarChecker
from loom.structured.grammar import (
    StructuredOutputsError,
    _byte_tokenizer,
    client_reason,
    grammar_for,
)
from loom.structured.limits import MAX_NESTING_DEPTH, MAX_SPEC_CHARS, nested_deeper_than
from loom.structured.schema import INTEGER_BOUND, MAX_STRING_LENGTH, prepare_schema

pytestmark = pytest.mark.unit


def nested_schema(depth: int) -> str:
    schema = '{"type": "integer"}'
    for _ in range(depth):
        schema = '{"type": "array", "items": ' + schema + "}"
    return schema


def chained_grammar(length: int) -> str:
    """Rules that each refer to the next: llguidance's compile recursed along the chain and
    overflowed its stack (a segfault) at a few thousand."""
    rules = "\n".join(f'r{i}: "ab" r{i + 1} | "c"' for i in range(length))
    return f'start: r0\n{rules}\nr{length}: "x"'


def allows(params: StructuredOutputsParams, text: str) -> bool:
    """Whether the compiled constraint takes `text`, whole, byte by byte."""
    import llguidance

    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar_for(params), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


# -- before any parser -------------------------------------------------------------------------


def test_a_schema_nested_900_deep_as_text_is_refused_not_a_recursion_error() -> None:
    """guided_json as a string nested ~900 deep raised RecursionError in `key` (a 500)."""
    with pytest.raises(SamplingParamsError, match="nests deeper than 64"):
        StructuredOutputsParams(json=nested_schema(900))
    with pytest.raises(SamplingParamsError, match="nests deeper than 64"):
        StructuredOutputsParams(json=json.loads(nested_schema(MAX_NESTING_DEPTH)))
    assert StructuredOutputsParams(json=nested_schema(20)).key[0] == "json"


def test_a_spec_over_the_size_limit_is_refused_before_it_is_parsed() -> None:
    grammar = "start: " + " | ".join(f'"word{i}"' for i in range(MAX_SPEC_CHARS // 8))
    with pytest.raises(SamplingParamsError, match="characters long"):
        StructuredOutputsParams(grammar=grammar)


def test_the_nesting_scan_skips_strings_and_stops_early() -> None:
    assert not nested_deeper_than('{"a": "' + "[" * 500 + '"}', 4)
    assert nested_deeper_than('{"a": "\\"", "b": [[[[[1]]]]]}', 4)
    assert nested_deeper_than(b"[" * 10_000_000, 64)  # no recursion, no closing needed


# -- what the grammar engine is given and what it says --------------------------------------------


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json={"$ref": "#"}),
    StructuredOutputsParams(grammar='start: start "a"'),
], ids=["self-ref schema", "left-recursive grammar"])
def test_a_constraint_with_an_empty_language_is_refused(params: StructuredOutputsParams) -> None:
    """These compiled and answered 200 with empty text and finish_reason stop."""
    with pytest.raises(StructuredOutputsError, match="allows no answer"):
        grammar_for(params)


def test_a_recursive_grammar_with_a_base_case_is_fine() -> None:
    assert allows(StructuredOutputsParams(grammar='start: "a" | start "a"'), "aaa")


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"enum": ["red", "blue"]}, "uniqueItems": True},
    {"type": "string", "not": {"const": "x"}},
    {"type": "string", "format": "regex"},
    {"type": "object", "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
     "if": {"properties": {"kind": {"const": "n"}}}, "then": {"required": ["n"]},
     "else": {"required": ["kind"]}},
], ids=["uniqueItems", "not", "format regex", "if-then-else"])
def test_keywords_pydantic_emits_compile(schema: dict) -> None:
    """llguidance refused each of these ("Unimplemented keys", "Unknown format")."""
    grammar_for(StructuredOutputsParams(json=schema))


def test_numbers_and_strings_are_bounded_by_default_and_by_the_schema() -> None:
    number = StructuredOutputsParams(json={"type": "number"})
    assert allows(number, "1.5") and allows(number, "-3.141592")
    assert not allows(number, "1.1971000")  # the digits that filled whole budgets
    assert not allows(number, "1" + "0" * 16)
    integer = StructuredOutputsParams(json={"type": "integer"})
    assert allows(integer, str(INTEGER_BOUND)) and not allows(integer, str(INTEGER_BOUND + 1))
    text = StructuredOutputsParams(json={"type": "string"})
    assert allows(text, json.dumps("a" * MAX_STRING_LENGTH))
    assert not allows(text, json.dumps("a" * (MAX_STRING_LENGTH + 1)))
    own = StructuredOutputsParams(json={"type": "string", "maxLength": 3})
    assert allows(own, '"abc"') and not allows(own, '"abcd"')
    looser = prepare_schema({"type": "number", "maximum": 1e30, "multipleOf": 0.5}, bool)
    assert looser["maximum"] == 1e15 and looser["multipleOf"] == 0.5


def test_digit_classes_in_a_regex_are_ascii_as_in_a_schema_pattern() -> None:
    """`\\d` in guided_regex took emoji and Arabic-Indic digits; in a pattern it did not."""
    for regex in (r"\d{2}", r"[\d]{2}", r"[a\d]{2}"):
        spec = StructuredOutputsParams(regex=regex)
        assert allows(spec, "42") and not allows(spec, "\u0664\u0662"), regex
    assert allows(StructuredOutputsParams(regex=r"\D\d"), "x4")
    assert not allows(StructuredOutputsParams(regex=r"\D"), "4")


def test_a_native_panic_never_reaches_the_client() -> None:
    panic = ("thread '<unnamed>' panicked at parser/src/earley/grammar.rs:42:\n"
             "index out of bounds\nstack backtrace:\n   0: rust_begin_unwind")
    assert client_reason(panic) == "the grammar engine failed on it"
    assert client_reason("line one\n   line two") == "line one line two"
    assert len(client_reason("x" * 10_000)) < 400


# -- the server's check in child processes ---------------------------------------------------


def test_a_grammar_that_overflows_the_compilers_stack_fails_alone() -> None:
    """Compiled in the server's process, it killed the server; in a child it is a 400 and the
    child is replaced."""
    async def run() -> tuple[str, None]:
        checker = GrammarChecker(workers=1, timeout=60)
        try:
            with pytest.raises(StructuredOutputsError) as crashed:
                await checker.check(StructuredOutputsParams(grammar=chained_grammar(4500)))
            await checker.check(StructuredOutputsParams(choice=["yes", "no"]))  # a new child
            return crashed.value.detail, None
        finally:
            checker.close()

    reason, _ = asyncio.run(run())
    assert "failed" in reason


def test_a_check_over_its_time_limit_fails_and_clients_take_turns() -> None:
    """One worker: client A's three slow grammars and then B's choice. B is served before A's
    second (clients take turns); a check past the time limit is a 400 saying so, and its
    cached verdict answers the same spec at once."""
    slow = [StructuredOutputsParams(grammar="start: " + " | ".join(
        f"/[a-z]{{2}}w{i}q{j}[0-9]+/" for i in range(4000))) for j in range(3)]
    finished: list[str] = []

    async def run() -> dict[str, str | None]:
        checker = GrammarChecker(workers=1, timeout=0.05)
        results: dict[str, str | None] = {}

        async def one(name: str, params: StructuredOutputsParams, client: str) -> None:
            try:
                await checker.check(params, client)
                results[name] = None
            except StructuredOutputsError as e:
                results[name] = e.detail
            finished.append(name)

        try:
            await asyncio.gather(*(one(f"A{j}", s, "A") for j, s in enumerate(slow)),
                                 one("B", StructuredOutputsParams(choice=["y"]), "B"))
            await one("A0 again", slow[0], "A")
        finally:
            checker.close()
        return results

    results = asyncio.run(run())
    assert finished.index("B") < finished.index("A1"), finished
    assert "took longer than 0.05 s" in results["A0"]
    assert results["A0 again"] == results["A0"] and finished[-1] == "A0 again"
