"""Tool-call parsers by the names vLLM's `--tool-call-parser` uses, and which one a chat
template implies."""

from __future__ import annotations

from typing import Literal

from loom.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
)
from loom.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from loom.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from loom.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from loom.entrypoints.openai.tool_parsers.phi4_mini import Phi4MiniToolParser
from loom.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

ToolParserName = Literal["hermes", "llama3_json", "mistral", "qwen3_coder", "phi4_mini"]
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "phi4_mini": Phi4MiniToolParser,
}


def parser_name_for_template(chat_template: str | None) -> str:
    """The parser a chat template's own tool format calls for; hermes otherwise (Qwen2.5's
    and Qwen3's format, and what loom's fallback tool prompt asks for when a template has
    no tool support)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    if "<function=" in template and "<parameter=" in template:  # before hermes: <tool_call>
        return "qwen3_coder"
    if "<|tool|>" in template:
        return "phi4_mini"
    return "hermes"


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParsedToolCall", "ToolParser",
           "ToolParserName", "parser_name_for_template"]
