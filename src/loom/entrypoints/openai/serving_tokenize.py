"""POST /tokenize and /detokenize in vLLM's shapes: a prompt (or chat messages, through the
chat template as /v1/chat/completions renders them) to token ids and back. The count agrees
with `usage.prompt_tokens` of the same prompt."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from loom.entrypoints.openai.serving_chat import render_chat


def add_tokenize_routes(app: FastAPI, engine: Any) -> None:
    """Add the two routes; `engine` is what the server holds (only `engine.core.tokenizer`
    and `.max_model_len` are read)."""
    tokenizer = engine.core.tokenizer
    max_model_len = engine.core.max_model_len

    def tokenize(request: TokenizeRequest) -> list[int]:
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if request.prompt is not None:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            return tokenizer.encode(request.prompt, add_special_tokens=add_special)
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        text = render_chat(tokenizer, request.messages, tools,
                           add_generation_prompt=request.add_generation_prompt,
                           template_kwargs=request.chat_template_kwargs)
        return tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))

    @app.post("/tokenize")
    async def create_tokenize(request: TokenizeRequest) -> TokenizeResponse:
        tokens = await asyncio.to_thread(tokenize, request)
        strs = [tokenizer.id_to_token(t) for t in tokens] if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens,
                                token_strs=strs)

    @app.post("/detokenize")
    async def create_detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        vocab = tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "tokens")
        text = await asyncio.to_thread(tokenizer.decode, request.tokens, False)
        return DetokenizeResponse(prompt=text)
