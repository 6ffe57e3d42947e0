"""Llama 3.1 / 3.2 JSON calls: the answer is `{"name": ..., "parameters": {...}}` (after an
optional `<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
    strict_json_prefix,
)

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    markers = (_TAG,)

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        body = text.strip().removeprefix(_TAG).strip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text, [])
        calls, at = [], 0
        while at < len(body):
            try:
                obj, length = strict_json_prefix(body[at:])
            except ValueError:
                return ExtractedToolCalls(text, [])
            end = at + length
            call = call_from_json(obj)
            if call is None:
                return ExtractedToolCalls(text, [])
            calls.append(call)
            at = end
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return ExtractedToolCalls(None, calls)

    def content_prefix(self, text: str) -> int:
        """An answer that starts (after blanks) with `{` may be a call: hold it all."""
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or _TAG.startswith(stripped[:len(_TAG)]):
            return 0
        return len(text)
