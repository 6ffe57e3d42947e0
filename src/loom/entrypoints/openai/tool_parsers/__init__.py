"""Tool-call parsers by the names vLLM's `--tool-call-parser` uses, and which one a chat
template implies."""

from __future__ import annotations

from loom.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
)
from loom.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from loom.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from loom.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def parser_name_for_template(chat_template: str | None) -> str:
    """The parser a chat template's own tool format calls for; hermes otherwise (what loom's
    fallback tool prompt asks for when a template has no tool support)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParsedToolCall", "ToolParser",
           "parser_name_for_template"]
