"""Qwen3.5's and Qwen3-Coder's calls (vLLM's `qwen3_coder`): XML, one block per call,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is written bare, so its type comes from the tool's schema: a string
parameter keeps the text as it is, any other type is read as JSON (a number, true, an
object...), falling back to the text where it is not JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from loom.entrypoints.openai.tool_parsers.base import (
    MarkedToolParser,
    ParsedToolCall,
    strict_json,
)

_MARKER = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|$)",
                    re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderToolParser(MarkedToolParser):
    markers = (_MARKER,)

    def calls(self, tail: str, marker: str, tools: Sequence[dict[str, Any]]
              ) -> list[ParsedToolCall] | None:
        blocks = list(_BLOCK.finditer(tail))
        if _BLOCK.sub("", tail).strip():  # text between calls, or a marker that opens none
            return None
        calls = []
        for block in blocks:
            name = block[1].strip()
            types = _parameter_types(tools, name)
            arguments = {key.strip(): _value(value, types.get(key.strip()))
                         for key, value in _PARAMETER.findall(block[2])}
            calls.append(ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        return calls


def _parameter_types(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """parameter -> its schema `type` (a name or a list of names), for the tool `name`."""
    for tool in tools:
        function = tool.get("function", {})
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {key: spec.get("type") for key, spec in properties.items()
                    if isinstance(spec, dict)}
    return {}


def _value(text: str, schema_type: Any) -> Any:
    kinds = schema_type if isinstance(schema_type, list) else [schema_type]
    if "string" in kinds:
        return text
    try:
        return strict_json(text)
    except ValueError:
        return text
