"""POST /v1/chat/completions: messages through the model's own chat template, n choices,
streamed (a role chunk, then content deltas) or not, with per-token logprobs."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request, Response

from loom.engine.async_engine import EngineRequest
from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from loom.entrypoints.openai.serving import (
    Choice,
    ClientStream,
    OpenAIServing,
    sse,
    usage,
)
from loom.outputs import CompletionOutput, RequestOutput, TokenLogprob


class ChatServing(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        token_ids = await asyncio.to_thread(self._render, request)  # long chats take a while
        budget_param = ("max_completion_tokens" if request.max_completion_tokens is not None
                        else "max_tokens")
        budget = (request.max_tokens if request.max_completion_tokens is None
                  else request.max_completion_tokens)
        max_tokens = self.max_tokens(budget, len(token_ids), "messages", budget_param)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        api_names = {"max_tokens": budget_param, "logprobs": "top_logprobs"}
        requests = [EngineRequest(f"{chat_id}-{i}", token_ids,
                                  self.sampling_params(request, i, api_names,
                                                       max_tokens=max_tokens, logprobs=logprobs),
                                  request.priority)
                    for i in range(request.n)]
        choices = {r.request_id: Choice(i) for i, r in enumerate(requests)}
        created = int(time.time())

        def events(stream: ClientStream, first: list[RequestOutput]) -> AsyncIterator[str]:
            return self._events(request, chat_id, created, stream, first, choices,
                                len(token_ids))

        def response(finals: dict[str, RequestOutput]) -> ChatCompletionResponse:
            return ChatCompletionResponse(
                id=chat_id, created=created, model=self.model_name,
                choices=[self._choice(request, finals[rid].outputs[0], choice.index)
                         for rid, choice in choices.items()],
                usage=usage(list(finals.values()), len(token_ids)))

        return await self.respond(raw_request, requests, "messages", request.stream, events,
                                  response)

    def _render(self, request: ChatCompletionRequest) -> list[int]:
        """The conversation through the model's chat template, as token ids."""
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, jinja2.TemplateError) as e:
            raise APIError(400, f"messages: {e}", "messages") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _choice(self, request: ChatCompletionRequest, completion: CompletionOutput,
                index: int) -> ChatChoice:
        return ChatChoice(
            index=index, message=AssistantMessage(content=completion.text),
            logprobs=self._logprobs(request, completion.token_ids, completion.logprobs),
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)

    async def _events(self, request: ChatCompletionRequest, chat_id: str, created: int,
                      stream: ClientStream, first: list[RequestOutput],
                      choices: dict[str, Choice], num_prompt_tokens: int
                      ) -> AsyncIterator[str]:
        def chunk(stream_choices: list[ChatStreamChoice], **extra: object) -> str:
            return sse(ChatCompletionChunk(id=chat_id, created=created, model=self.model_name,
                                           choices=stream_choices, **extra))

        def delta(output: RequestOutput, choice: Choice) -> str | None:
            completion = output.outputs[0]
            text, start = choice.progress.advance(completion)
            end = len(completion.token_ids)
            logprobs = self._logprobs(request, completion.token_ids[start:end],
                                      (completion.logprobs or [])[start:end])
            if not output.finished and not text and logprobs is None:
                return None  # tokens that are no text yet (half a UTF-8 char, a stop prefix)
            return chunk([ChatStreamChoice(
                index=choice.index, delta=DeltaMessage(content=text), logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)])

        for choice in choices.values():
            yield chunk([ChatStreamChoice(index=choice.index,
                                          delta=DeltaMessage(role="assistant", content=""))])
        usage_chunk = ((lambda finals: chunk([], usage=usage(finals, num_prompt_tokens)))
                       if request.include_usage else None)
        async for event in self.stream_events(stream, first, choices, delta, usage_chunk):
            yield event

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                  entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if not request.logprobs or entries is None:
            return None

        def top(token_id: int, logprob: float) -> TopLogprob:
            token = self.tokenizer.id_to_token(token_id)
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**top(token_id, entry.logprob).model_dump(),
                             top_logprobs=[top(t, lp) for t, lp in entry.top])
            for token_id, entry in zip(token_ids, entries)])
