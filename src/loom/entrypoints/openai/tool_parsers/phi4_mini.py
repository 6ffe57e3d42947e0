"""Phi-4-mini's calls (vLLM's `phi4_mini_json`): a JSON list of {"name", "arguments"}
after `functools` (what its model card's tool prompt asks for), or between `<|tool_call|>`
and `<|/tool_call|>` (its vocabulary's tool tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
    content_or_none,
    strict_json_prefix,
)

_MARKERS = ("functools", "<|tool_call|>")
_END = "<|/tool_call|>"


class Phi4MiniToolParser(ToolParser):
    markers = _MARKERS

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        found = [(at, marker) for marker in _MARKERS if (at := text.find(marker)) != -1]
        if not found:
            return ExtractedToolCalls(text, [])
        start, marker = min(found)
        body = text[start + len(marker):].strip()
        try:
            items, end = strict_json_prefix(body)
        except ValueError:
            return ExtractedToolCalls(text, [])
        if body[end:].strip() not in ("", _END):
            return ExtractedToolCalls(text, [])
        calls = [call_from_json(item) for item in (items if isinstance(items, list) else [items])]
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(content_or_none(text[:start]),
                                  [c for c in calls if c is not None])
