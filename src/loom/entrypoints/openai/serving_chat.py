"""POST /v1/chat/completions: messages through the model's own chat template, n choices,
streamed (a role chunk, then content deltas) or not, with per-token logprobs."""

from __future__ import annotations

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
    CLIENT_CLOSED,
    ChoiceProgress,
    ClientStream,
    OpenAIServing,
    check_failed,
    sse,
    usage,
)
from loom.outputs import RequestOutput, TokenLogprob


class ChatServing(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"
        token_ids = self._render(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        budget_param = ("max_completion_tokens" if request.max_completion_tokens is not None
                        else "max_tokens")
        max_tokens = self.max_tokens(request.max_completion_tokens or request.max_tokens,
                                     len(token_ids), "messages", budget_param)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        requests = [EngineRequest(f"{chat_id}-{i}", token_ids,
                                  self.sampling_params(request, i, max_tokens=max_tokens,
                                                       logprobs=logprobs),
                                  request.priority)
                    for i in range(request.n)]
        index = {r.request_id: i for i, r in enumerate(requests)}

        started = await self.start(raw_request, requests, "messages")
        if started is None:
            return Response(status_code=CLIENT_CLOSED)
        stream, first = started
        if request.stream:
            return self.sse_response(stream, self._events(
                request, chat_id, stream, first, index, len(token_ids)))
        finals = await self.finish(stream, first, len(requests))
        if finals is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for request_id, i in index.items():
            completion = finals[request_id].outputs[0]
            choices.append(ChatChoice(
                index=i, message=AssistantMessage(content=completion.text),
                logprobs=self._logprobs(request, completion.token_ids, completion.logprobs),
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
        response = ChatCompletionResponse(id=chat_id, model=self.model_name, choices=choices,
                                          usage=usage(list(finals.values()), len(token_ids)))
        return Response(response.model_dump_json(), media_type="application/json")

    def _render(self, request: ChatCompletionRequest) -> list[int]:
        """The conversation through the model's chat template, as token ids."""
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, jinja2.TemplateError) as e:
            raise APIError(400, f"messages: {e}", "messages") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _events(self, request: ChatCompletionRequest, chat_id: str,
                      stream: ClientStream, first: list[RequestOutput], index: dict[str, int],
                      num_prompt_tokens: int) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], **extra: object) -> str:
            return sse(ChatCompletionChunk(id=chat_id, created=created, model=self.model_name,
                                           choices=choices, **extra))

        for i in index.values():
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                      content=""))])
        progress = {request_id: ChoiceProgress() for request_id in index}
        finals: list[RequestOutput] = []
        outputs: list[RequestOutput] | None = first
        while outputs is not None:
            for output in outputs:
                check_failed(output)
                completion, choice = output.outputs[0], progress[output.request_id]
                if not output.finished and choice.pending(completion) < self.stream_interval:
                    continue
                text, start = choice.advance(completion)
                end = len(completion.token_ids)
                logprobs = self._logprobs(request, completion.token_ids[start:end],
                                          (completion.logprobs or [])[start:end])
                if output.finished:
                    finals.append(output)
                elif not text and logprobs is None:
                    continue  # tokens that are no text yet (half a UTF-8 char, a stop prefix)
                yield chunk([ChatStreamChoice(
                    index=index[output.request_id], delta=DeltaMessage(content=text),
                    logprobs=logprobs, finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason)])
            outputs = await anext(stream, None)
        if request.include_usage and len(finals) == len(index):
            yield chunk([], usage=usage(finals, num_prompt_tokens))

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
