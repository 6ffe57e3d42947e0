"""POST /tokenize and /detokenize in vLLM's shapes: a prompt (or chat messages, through the
chat template as /v1/chat/completions renders them) to token ids and back. The count agrees
with `usage.prompt_tokens` of the same prompt.

All the work, the answer's JSON included, runs on a worker thread: a 3.8 MB prompt with
`return_token_strs` made 17 MB of answer and held /health for seconds when its strings and
JSON were built on the event loop. The text tokenized is capped (MAX_TOKENIZE_CHARS).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Response

from loom.engine.client import EngineClient
from loom.entrypoints.openai.chat_messages import chat_prompt_ids
from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

MAX_TOKENIZE_CHARS = 2**20  # of a prompt, or of a chat's messages together


def add_tokenize_routes(app: FastAPI, engine: EngineClient,
                        special_tokens_in_content: bool = False) -> None:
    """Add the two routes (they read only the engine's tokenizer and max_model_len)."""
    tokenizer = engine.tokenizer
    max_model_len = engine.facts.max_model_len

    def tokenize(request: TokenizeRequest) -> list[int]:
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if request.prompt is not None:
            _check_size(len(request.prompt), "prompt")
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            return tokenizer.encode(request.prompt, add_special_tokens=add_special)
        _check_size(sum(len(m.text()) for m in request.messages), "messages")
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        _, ids = chat_prompt_ids(tokenizer, request.messages, tools,
                                 add_generation_prompt=request.add_generation_prompt,
                                 template_kwargs=request.chat_template_kwargs,
                                 special_tokens_in_content=special_tokens_in_content)
        # what the tokenizer adds to any text (a BOS) where asked to
        return [*tokenizer.encode("", True), *ids] if request.add_special_tokens else ids

    def answer(request: TokenizeRequest) -> Response:
        tokens = tokenize(request)
        strs = [tokenizer.id_to_token(t) for t in tokens] if request.return_token_strs else None
        body = TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens,
                                token_strs=strs)
        return Response(body.model_dump_json(), media_type="application/json")

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def create_tokenize(request: TokenizeRequest) -> Response:
        return await asyncio.to_thread(answer, request)

    @app.post("/detokenize")
    async def create_detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        vocab = tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "tokens")
        text = await asyncio.to_thread(tokenizer.decode, request.tokens, False)
        return DetokenizeResponse(prompt=text)


def _check_size(num_chars: int, param: str) -> None:
    if num_chars > MAX_TOKENIZE_CHARS:
        raise APIError(400, f"{param} holds {num_chars} characters; /tokenize takes at most "
                       f"{MAX_TOKENIZE_CHARS}", param)
