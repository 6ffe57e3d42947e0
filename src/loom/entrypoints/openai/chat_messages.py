"""A chat request's messages as chat templates read them, through the template to token ids:
what /v1/chat/completions and /tokenize both make, a conversation the template refuses being
a 400 naming the field."""

from __future__ import annotations

from typing import Any

import jinja2

from loom.entrypoints.openai.chat_prompt import encode_chat
from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import ChatMessage
from loom.entrypoints.openai.tool_parsers.base import strict_json


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage],
                    tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                    param: str = "messages", template_kwargs: dict[str, Any] | None = None,
                    special_tokens_in_content: bool = False) -> tuple[str, list[int]]:
    """The conversation (and tools) through the tokenizer's chat template, as the rendered
    text and its token ids, the client's text kept as text (chat_prompt.py): what
    /v1/chat/completions and /tokenize both make. A conversation the template refuses (or a
    tool call whose arguments are not JSON) is a 400 naming `param`."""
    try:
        return encode_chat(tokenizer, [template_message(m) for m in messages], tools or None,
                           add_generation_prompt, template_kwargs, special_tokens_in_content)
    except (ValueError, jinja2.TemplateError) as e:
        raise APIError(400, f"{param}: {e}", param) from e


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (transformers' convention: a tool call's arguments
    as a dict, not JSON text)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": _arguments(c.function.arguments)}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(text: str) -> Any:
    """A tool call's JSON arguments; a ValueError (naming what is wrong) where they are not
    JSON, which the caller turns into a 400 naming its own field."""
    try:
        return strict_json(text)
    except ValueError as e:
        raise ValueError(f"tool call arguments are not JSON: {e}") from e
