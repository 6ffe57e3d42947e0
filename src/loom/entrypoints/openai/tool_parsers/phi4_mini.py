"""Phi-4-mini's calls (vLLM's `phi4_mini_json`): a JSON list of {"name", "arguments"}
after `functools` (what its model card's tool prompt asks for), or between `<|tool_call|>`
and `<|/tool_call|>` (its vocabulary's tool tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.entrypoints.openai.tool_parsers.base import (
    MarkedToolParser,
    ParsedToolCall,
    calls_from_json_items,
    strict_json_prefix,
)

_MARKERS = ("functools", "<|tool_call|>")
_END = "<|/tool_call|>"


class Phi4MiniToolParser(MarkedToolParser):
    markers = _MARKERS

    def calls(self, tail: str, marker: str, tools: Sequence[dict[str, Any]]
              ) -> list[ParsedToolCall] | None:
        body = tail[len(marker):].strip()
        try:
            items, end = strict_json_prefix(body)
        except ValueError:
            return None
        if body[end:].strip() not in ("", _END):
            return None
        return calls_from_json_items(items)
