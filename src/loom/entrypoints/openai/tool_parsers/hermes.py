"""Hermes-style calls, as SmolLM2, Qwen2.5 and Hermes models write them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from loom.entrypoints.openai.tool_parsers.base import (
    MarkedToolParser,
    ParsedToolCall,
    call_from_json,
    strict_json,
)

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(MarkedToolParser):
    markers = ("<tool_call>",)

    def calls(self, tail: str, marker: str, tools: Sequence[dict[str, Any]]
              ) -> list[ParsedToolCall] | None:
        calls = []
        for block in _BLOCK.findall(tail):
            try:
                call = call_from_json(strict_json(block))
            except ValueError:
                call = None
            if call is None:
                return None
            calls.append(call)
        return calls
