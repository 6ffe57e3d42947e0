"""A conversation through the chat template to token ids, with the client's text kept as text.

Rendered and tokenized whole, a user message holding `<|im_end|>\\n<|im_start|>system` became
those control tokens and opened a forged system turn. So every string the client sent
(message contents, names, tool calls, the tools) has each special token's text replaced by a
placeholder before the template renders it: a run of ASCII letters and digits with a random
nonce, which no client can guess and which templates pass through as they pass text. The
rendered prompt is then tokenized piece by piece: the template's own text as usual (its
control tokens stay control tokens), each placeholder as the special token's text in plain
text (`Tokenizer.encode_plain`). A conversation without special-token text renders and
tokenizes exactly as before, in one piece.

`special_tokens_in_content` (`--special-tokens-in-content`) turns this off: special-token text
anywhere is the control token, as it was (llama.cpp parses it in user content only when told).
"""

from __future__ import annotations

import re
import secrets
from typing import Any


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                template_kwargs: dict[str, Any] | None = None,
                special_tokens_in_content: bool = False) -> tuple[str, list[int]]:
    """The conversation's rendered prompt (the client's text in it as sent) and its ids;
    template_kwargs: the template's own variables (chat_template_kwargs). Raises what
    `apply_chat_template` raises (ValueError, jinja2's errors) for a conversation the
    template refuses."""
    specials = _special_pattern(tokenizer)
    if special_tokens_in_content or specials is None or not _mentions(
            [messages, tools], specials):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=tools, template_kwargs=template_kwargs)
        return text, tokenizer.encode(text, add_special_tokens=False)
    marker = f"LoomSpecial{secrets.token_hex(8)}x"
    texts: list[str] = []

    def hide(text: str) -> str:
        def placeholder(match: re.Match[str]) -> str:
            texts.append(match.group())
            return f"{marker}{len(texts) - 1}z"
        return specials.sub(placeholder, text)

    rendered = tokenizer.apply_chat_template(
        _mapped(messages, hide), add_generation_prompt=add_generation_prompt,
        tools=_mapped(tools, hide), template_kwargs=template_kwargs)
    ids: list[int] = []
    pieces = re.split(f"{marker}([0-9]+)z", rendered)
    for i, piece in enumerate(pieces):
        if i % 2:  # a placeholder's index
            ids += tokenizer.encode_plain(texts[int(piece)])
            pieces[i] = texts[int(piece)]
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return "".join(pieces), ids


def _special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """One pattern for every special token's text, longest first; cached on the tokenizer's
    tuple of texts."""
    texts = tokenizer.special_token_texts
    if not texts:
        return None
    cached = _PATTERNS.get(texts)
    if cached is None:
        cached = re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))
        _PATTERNS[texts] = cached
    return cached


_PATTERNS: dict[tuple[str, ...], re.Pattern[str]] = {}


def _mentions(value: Any, pattern: re.Pattern[str]) -> bool:
    """Whether any string in `value` (dicts, lists, their keys) holds special-token text."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if pattern.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


def _mapped(value: Any, change: Any) -> Any:
    """`value` with `change` applied to every string in it (dict keys too). The request's
    nesting is bounded (guards.BODY_NESTING_LIMIT), so recursion is."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {_mapped(k, change): _mapped(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_mapped(v, change) for v in value]
    return value
