"""What the completions and chat endpoints share: limits and sampling parameters, submitting to
the engine with the request tied to its HTTP connection, and server-sent events.

A response's status is decided by the engine's first answer (the first output, or an error
such as a prompt the engine can never run or a queue timeout), so streaming responses send
their headers only then: a request the engine refuses still gets a clean 4xx/503 instead of a
200 with an error inside.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from loom.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    OutputStream,
    RequestRejectedError,
)
from loom.entrypoints.openai.errors import APIError, error_body
from loom.entrypoints.openai.protocol import SamplingRequest, UsageInfo
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling import SamplingParams

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but the log shows why


# JSON may carry these raw inside strings, but many line readers (Python's str.splitlines,
# httpx's aiter_lines) break lines on them, which cuts an SSE event in two: escape them.
_LINE_BREAKS_JSON_ALLOWS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                          "\u2029": "\\u2029"})


def sse(message: BaseModel) -> str:
    return f"data: {message.model_dump_json().translate(_LINE_BREAKS_JSON_ALLOWS)}\n\n"


class ClientStream:
    """An engine OutputStream bound to the HTTP connection that asked for it: when the client
    disconnects (streaming or not), or the response ends, the stream is closed, which aborts
    whatever has not finished so its KV blocks are freed at the next step."""

    def __init__(self, stream: OutputStream, request: Request) -> None:
        self._stream = stream
        self._watcher = asyncio.create_task(self._close_on_disconnect(request))

    async def _close_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        logger.info("Client disconnected from %s; aborting its requests", request.url.path)
        self._stream.close()

    def __aiter__(self) -> ClientStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        return await self._stream.__anext__()

    def close(self) -> None:
        self._watcher.cancel()
        self._stream.close()


@dataclass
class ChoiceProgress:
    """How much of one choice has been sent, so each chunk carries only what is new."""

    num_tokens: int = 0
    num_chars: int = 0

    def pending(self, completion: CompletionOutput) -> int:
        return len(completion.token_ids) - self.num_tokens

    def advance(self, completion: CompletionOutput) -> tuple[str, int]:
        """(new text, index of the first new token) since the last call."""
        text, first = completion.text[self.num_chars:], self.num_tokens
        self.num_chars, self.num_tokens = len(completion.text), len(completion.token_ids)
        return text, first


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, stream_interval: int) -> None:
        self.engine = engine
        self.tokenizer = engine.core.tokenizer
        self.max_model_len = engine.core.max_model_len
        self.kv_capacity = engine.core.num_kv_blocks * engine.core.block_size  # tokens
        self.model_name = model_name
        self.stream_interval = stream_interval

    # -- turning a request into engine requests ----------------------------------------------

    def max_tokens(self, requested: int | None, num_prompt_tokens: int, prompt_param: str,
                   max_tokens_param: str = "max_tokens") -> int:
        """The output budget: as requested if prompt + output fit max_model_len, else a 400;
        when not given, whatever room the context has left, up to what the whole KV cache
        holds (the engine refuses requests that could outgrow it)."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"{prompt_param} has {num_prompt_tokens} tokens, but this "
                           f"model's max_model_len is {self.max_model_len} (prompt and at "
                           "least one output token must fit)", prompt_param)
        if requested is None:
            return max(1, min(room, self.kv_capacity - num_prompt_tokens))
        if requested > room:
            raise APIError(400, f"{max_tokens_param}={requested} is too large: the "
                           f"{prompt_param} has {num_prompt_tokens} tokens and max_model_len "
                           f"is {self.max_model_len}, so at most {room} can be generated",
                           max_tokens_param)
        return requested

    @staticmethod
    def sampling_params(request: SamplingRequest, choice: int, **kwargs: int | None
                        ) -> SamplingParams:
        """Choice `choice` of n draws with seed + choice, so seeded choices still differ."""
        try:
            return SamplingParams(
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=request.top_k if request.top_k not in (None, 0) else -1,
                seed=None if request.seed is None else request.seed + choice,
                min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
                stop=request.stop or [], stop_token_ids=request.stop_token_ids or [], **kwargs)
        except ValueError as e:
            field = str(e).split()[0]
            raise APIError(400, str(e),
                           field if field in type(request).model_fields else None) from e

    # -- running them --------------------------------------------------------------------------

    async def start(self, raw_request: Request, requests: list[EngineRequest],
                    prompt_param: str) -> tuple[ClientStream, list[RequestOutput]] | None:
        """Submit and wait for the engine's first outputs; None if the client left first.
        Raises what the status should say: APIError(400) for a prompt the engine can never
        run, RequestRejectedError (503) from admission control, EngineDeadError (503)."""
        stream = ClientStream(self.engine.submit(requests), raw_request)
        try:
            first = await anext(stream, None)
        except ValueError as e:
            stream.close()
            raise APIError(400, str(e), prompt_param) from e
        except BaseException:
            stream.close()
            raise
        if first is None:
            stream.close()
            return None
        return stream, first

    @staticmethod
    async def finish(stream: ClientStream, first: list[RequestOutput], num_requests: int
                     ) -> dict[str, RequestOutput] | None:
        """The final output of every request; None if the client left first. A request the
        engine failed is a 500 (for this HTTP request only)."""
        finals: dict[str, RequestOutput] = {}
        try:
            outputs: list[RequestOutput] | None = first
            while outputs is not None:
                for output in outputs:
                    if output.finished:
                        check_failed(output)
                        finals[output.request_id] = output
                outputs = await anext(stream, None)
        finally:
            stream.close()
        return finals if len(finals) == num_requests else None

    @staticmethod
    def sse_response(stream: ClientStream, events: AsyncIterator[str]) -> StreamingResponse:
        """Send `events`, then `data: [DONE]`. An error after the headers went out becomes an
        OpenAI-style error event, as vLLM sends it."""

        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except APIError as e:
                yield sse(error_body(e.message, e.type, e.param))
            except (RequestRejectedError, EngineDeadError) as e:
                yield sse(error_body(str(e), "service_unavailable_error"))
            except Exception as e:  # noqa: BLE001 - fail this response alone, and say why
                logger.exception("Streaming response failed")
                yield sse(error_body(f"{type(e).__name__}: {e}", "internal_server_error"))
            finally:
                stream.close()
            yield SSE_DONE

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def check_failed(output: RequestOutput) -> None:
    if output.error is not None:
        raise APIError(500, f"the engine failed this request: {output.error}",
                       type_="internal_server_error")


def usage(finals: list[RequestOutput], num_prompt_tokens: int) -> UsageInfo:
    completion = sum(len(o.outputs[0].token_ids) for o in finals)
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                     total_tokens=num_prompt_tokens + completion)
