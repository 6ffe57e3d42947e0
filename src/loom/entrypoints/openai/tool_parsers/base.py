"""What every tool-call parser does: split a model's answer into content and tool calls, and
say how much of a partial answer is surely content (so a stream can send it at once)."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text that is not a tool call (None when there is none)
    calls: list[ParsedToolCall]


class ToolParser:
    """One model family's way of writing tool calls. `markers` are the texts that open a
    call; a streamed answer holds back text that could be the start of one."""

    markers: tuple[str, ...] = ()

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        """`tools` (OpenAI's shape) are for formats that write arguments untyped (Qwen3.5's
        XML parameters), whose values the parameters' schema types."""
        raise NotImplementedError

    def content_prefix(self, text: str) -> int:
        """How many leading characters of a partial answer are content whatever follows."""
        cut = len(text)
        for marker in self.markers:
            at = text.find(marker)
            if at != -1:
                cut = min(cut, at)
                continue
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:n]):
                    cut = min(cut, len(text) - n)
                    break
        return cut


class MarkedToolParser(ToolParser):
    """A format whose calls follow the first of its markers, with only content before it:
    a subclass reads the calls, this finds where they start and what stays content."""

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        found = [(at, marker) for marker in self.markers if (at := text.find(marker)) != -1]
        if not found:
            return ExtractedToolCalls(text, [])
        start, marker = min(found)
        calls = self.calls(text[start:], marker, tools)
        if not calls:  # not calls after all: the whole answer is content
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(content_or_none(text[:start]), calls)

    def calls(self, tail: str, marker: str, tools: Sequence[dict[str, Any]]
              ) -> list[ParsedToolCall] | None:
        """The calls `tail` (the answer from `marker` on) writes; None (or none) if it is
        anything else."""
        raise NotImplementedError


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"{number} is not a finite number")
    return value


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


# JSON as OpenAI's clients parse it: no NaN, Infinity or a number that overflows to one
# (Python's json takes them; JSON.parse does not)
_STRICT = json.JSONDecoder(parse_float=_finite, parse_constant=_refuse)


def strict_json(text: str) -> Any:
    """`text` as JSON, strictly (above): ValueError otherwise, and for nesting deeper than
    Python recurses."""
    value, end = strict_json_prefix(text.strip())
    if end != len(text.strip()):
        raise ValueError(f"extra data after the JSON value at {end}")
    return value


def strict_json_prefix(text: str) -> tuple[Any, int]:
    """The JSON value `text` starts with (strictly, as strict_json) and where it ends."""
    try:
        return _STRICT.raw_decode(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def call_from_json(obj: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
                   ) -> ParsedToolCall | None:
    """{"name": ..., "arguments": {...}} (or "parameters", or arguments as JSON text) as a
    call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):
        try:
            arguments = strict_json(arguments)
        except ValueError:
            return None
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def calls_from_json_items(items: Any) -> list[ParsedToolCall] | None:
    """A JSON list of calls (or one call) as `call_from_json` reads each; None if any item
    is not a call, or there are none."""
    calls = [call_from_json(item) for item in (items if isinstance(items, list) else [items])]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def content_or_none(text: str) -> str | None:
    """The text before the calls, as a stream sends it; None if it is only blanks."""
    return text if text.strip() else None
