"""Server-sent events must survive line readers that split on more than LF (httpx's
aiter_lines, str.splitlines): text the model generates may hold U+2028, U+2029 or NEL."""

from __future__ import annotations

import json

import pytest

from loom.entrypoints.openai.protocol_answers import CompletionChoice, CompletionResponse
from loom.entrypoints.openai.sse import sse

pytestmark = pytest.mark.unit


def test_sse_event_is_one_line_whatever_the_text() -> None:
    text = "a\u2028b\u2029c\x85d\ne\rf"
    event = sse(CompletionResponse(
        id="x", created=0, model="m",
        choices=[CompletionChoice(index=0, text=text)]))
    assert event.endswith("\n\n")
    (line,) = event[:-2].splitlines()
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


def test_a_lone_surrogate_is_found_at_any_depth_and_named_by_its_path() -> None:
    from loom.entrypoints.openai.protocol import lone_surrogate_path

    assert lone_surrogate_path({"a": ["ok", {"b": "fine \U0001f600"}], "n": [1, 2.0]}) is None
    assert lone_surrogate_path({"a": ["ok", {"b": "x\ud800"}]}) == ["a", 1, "b"]
    assert lone_surrogate_path({"a": {"\udc00": 1}}) == ["a"]  # a key: its object
    deep: list = ["\udfff"]
    for _ in range(5000):  # deeper than Python recurses
        deep = [deep]
    assert lone_surrogate_path({"x": deep}) == ["x"] + [0] * 5001
