"""Mistral calls: `[TOOL_CALLS]` then a JSON list of {"name": ..., "arguments": {...}};
Mistral's templates want tool call ids of nine letters and digits."""

from __future__ import annotations

import json
import secrets
import string

from loom.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
    content_or_none,
)

_MARKER = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


def mistral_tool_call_id() -> str:
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


class MistralToolParser(ToolParser):
    markers = (_MARKER,)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(_MARKER)
        if start == -1:
            return ExtractedToolCalls(text, [])
        try:
            items, _ = json.JSONDecoder().raw_decode(text[start + len(_MARKER):].strip())
        except ValueError:
            return ExtractedToolCalls(text, [])
        calls = [call_from_json(item) for item in (items if isinstance(items, list) else [items])]
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(text, [])
        for call in calls:
            call.id = mistral_tool_call_id()
        return ExtractedToolCalls(content_or_none(text[:start]), calls)
