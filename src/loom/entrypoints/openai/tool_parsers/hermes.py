"""Hermes-style calls, as SmolLM2, Qwen2.5 and Hermes models write them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from loom.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
    content_or_none,
    strict_json,
)

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    markers = ("<tool_call>",)

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        start = text.find("<tool_call>")
        if start == -1:
            return ExtractedToolCalls(text, [])
        calls = []
        for block in _BLOCK.findall(text, start):
            try:
                call = call_from_json(strict_json(block))
            except ValueError:
                call = None
            if call is None:  # not a call after all: the whole answer is content
                return ExtractedToolCalls(text, [])
            calls.append(call)
        return ExtractedToolCalls(content_or_none(text[:start]), calls)
