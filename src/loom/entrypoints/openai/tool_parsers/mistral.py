"""Mistral calls, in the three ways Mistral's templates write them:

- `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo),
- `[TOOL_CALLS]name[ARGS]{...}` per call (Devstral, Magistral: tokenizer v11),
- `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` per call (Mistral Small 3.2).

Mistral's templates want tool call ids of nine letters and digits; a call's own id is kept
when it has that shape.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from typing import Any

from loom.entrypoints.openai.tool_parsers.base import (
    MarkedToolParser,
    ParsedToolCall,
    calls_from_json_items,
    strict_json_prefix,
)

_MARKER = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits
# name, then an optional [CALL_ID]id, then [ARGS] and the JSON arguments
_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")


def mistral_tool_call_id() -> str:
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


class MistralToolParser(MarkedToolParser):
    markers = (_MARKER,)

    def calls(self, tail: str, marker: str, tools: Sequence[dict[str, Any]]
              ) -> list[ParsedToolCall] | None:
        calls: list[ParsedToolCall] = []
        for block in tail[len(marker):].split(marker):
            found = _json_list(block) if block.lstrip().startswith(("[", "{")) \
                else _named_call(block)
            if found is None:
                return None
            calls += found
        for call in calls:
            if not (len(call.id) == 9 and call.id.isalnum()):
                call.id = mistral_tool_call_id()
        return calls


def _json_list(block: str) -> list[ParsedToolCall] | None:
    try:
        items, _ = strict_json_prefix(block.strip())
    except ValueError:
        return None
    return calls_from_json_items(items)


def _named_call(block: str) -> list[ParsedToolCall] | None:
    head = _NAMED.match(block)
    if head is None:
        return None
    try:
        arguments, _ = strict_json_prefix(block[head.end():].strip())
    except ValueError:
        return None
    call = ParsedToolCall(head[1], json.dumps(arguments, ensure_ascii=False))
    if head[2]:
        call.id = head[2]
    return [call]
