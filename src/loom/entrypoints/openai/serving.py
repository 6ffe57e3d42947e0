"""What the completions and chat endpoints share: limits and sampling parameters, submitting to
the engine with the request tied to its HTTP connection, and the one streaming loop (its events
are sse.py's; which field asked for a constraint, constraints.py's).

A response's status is decided by the engine's first answer (the first output, or an error
such as a prompt the engine can never run or a queue timeout), so streaming responses send
their headers only then: a request the engine refuses still gets a clean 4xx/503 instead of a
200 with an error inside.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request, Response
from pydantic import BaseModel

from loom.engine.async_engine import (
    EngineRequest,
    OutputStream,
)
from loom.engine.client import EngineClient
from loom.entrypoints.openai.constraints import Constraint, fields_kind, structured_spec
from loom.entrypoints.openai.errors import INTERNAL_ERROR, APIError
from loom.entrypoints.openai.fairness import ClientLimiter, client_of
from loom.entrypoints.openai.protocol import SamplingRequest
from loom.entrypoints.openai.protocol_answers import PromptTokensDetails, UsageInfo
from loom.entrypoints.openai.sse import StreamEnding, sse_response
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling import (
    SEED_RANGE,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from loom.structured import GRAMMAR_ERROR_PREFIX
from loom.structured.checker import GrammarChecker
from loom.structured.grammar import StructuredOutputsError, check_writable

logger = logging.getLogger(__name__)

_DONE_ENDING = StreamEnding()  # chat and completions: data: [DONE] last
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but the log shows why


class ClientStream:
    """An engine OutputStream bound to the HTTP connection that asked for it: when the client
    disconnects (streaming or not), or the response ends, the stream is closed, which aborts
    whatever has not finished so its KV blocks are freed at the next step."""

    def __init__(self, stream: OutputStream, request: Request,
                 constraint_param: str = "structured_outputs",
                 on_close: Callable[[], None] | None = None) -> None:
        self._stream = stream
        self.constraint_param = constraint_param  # the field a failed constraint came from
        self._on_close = on_close
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
        if self._on_close is not None:
            self._on_close, on_close = None, self._on_close
            on_close()


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


@dataclass
class Choice:
    """One engine request of an HTTP request: its choice index and what it has sent."""

    index: int
    progress: ChoiceProgress = field(default_factory=ChoiceProgress)


C = TypeVar("C", bound=Choice)


class OpenAIServing:
    """`checker` checks constraints (one for every endpoint, so its cache and its child
    processes are shared); `limiter` bounds each client's engine requests;
    `max_tokens_default` bounds a chat answer that names no budget (None: the rest of the
    context)."""

    def __init__(self, engine: EngineClient, model_name: str, stream_interval: int, *,
                 checker: GrammarChecker | None = None, limiter: ClientLimiter | None = None,
                 max_tokens_default: int | None = None) -> None:
        self.engine = engine
        facts = engine.facts
        self.tokenizer = engine.tokenizer
        self.vocab_size = self.tokenizer.vocab_size
        self.max_model_len = facts.max_model_len
        self.kv_capacity = facts.kv_capacity  # tokens
        self.model_name = model_name
        self.stream_interval = stream_interval
        self.checker = checker or GrammarChecker(workers=1, timeout=10.0)
        self.limiter = limiter or ClientLimiter(None)
        self.max_tokens_default = max_tokens_default
        # the model's own defaults (--generation-config) for what a request leaves unset
        self.sampling_defaults = facts.sampling_defaults

    # -- turning a request into engine requests ----------------------------------------------

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize on a worker thread: a prompt of megabytes takes seconds, during which the
        event loop must go on streaming and answering /health."""
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise APIError(400, f"{param} token ids must be in [0, {self.vocab_size})", param)

    def max_tokens(self, requested: int | None, num_prompt_tokens: int, prompt_param: str,
                   max_tokens_param: str = "max_tokens") -> int | None:
        """The output budget: as requested if prompt + output fit max_model_len, else a 400;
        when not given, `max_tokens_default` or whatever room the context has left if less,
        up to what the whole KV cache holds (the engine refuses requests that could outgrow
        it). Values that are no budget at all (< 1) are left to SamplingParams to refuse."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"{prompt_param} has {num_prompt_tokens} tokens, but this "
                           f"model's max_model_len is {self.max_model_len} (prompt and at "
                           "least one output token must fit)", prompt_param)
        if requested is None:
            default = room if self.max_tokens_default is None else self.max_tokens_default
            return max(1, min(room, default, self.kv_capacity - num_prompt_tokens))
        if requested > room:
            raise APIError(400, f"{max_tokens_param}={requested} is too large: the "
                           f"{prompt_param} has {num_prompt_tokens} tokens and max_model_len "
                           f"is {self.max_model_len}, so at most {room} can be generated",
                           max_tokens_param)
        return requested

    async def structured_outputs(self, request: SamplingRequest, raw_request: Request,
                                 format_param: str = "response_format") -> Constraint | None:
        """The request's constraint, from whichever spelling it used (vLLM's
        `structured_outputs`, a `guided_*` field, OpenAI's `response_format`), checked here
        (`checked_constraint`) so a spec that cannot compile, or a choice the vocabulary cannot
        write, is a 400 naming the field."""
        found = structured_spec(request, format_param)
        return None if found is None else await self.checked_constraint(*found, raw_request)

    async def checked_constraint(self, param: str, fields: Mapping[str, object],
                                 raw_request: Request) -> Constraint:
        """The constraint of `fields`, its size checked at once, then compiled in one of the
        checker's processes (bounded in time; cached) and checked against the vocabulary on
        a worker thread; what fails is a 400 naming `param`, the field it came from."""
        try:
            spec = StructuredOutputsParams(**fields)
            await self.checker.check(spec, client_of(raw_request.scope))
            await asyncio.to_thread(check_writable, spec, self.tokenizer)
        except StructuredOutputsError as e:
            raise APIError(400, f"{param}: {e.detail}", param) from e
        except SamplingParamsError as e:
            reason = e.reason.removeprefix(f"{fields_kind(fields)}: ")
            raise APIError(400, f"{param}: {reason}", param) from e
        return Constraint(spec, param)

    def sampling_params(self, request: SamplingRequest, choice: int,
                        api_names: Mapping[str, str], **kwargs: object) -> SamplingParams:
        """Choice `choice` of n draws with seed + choice, so seeded choices still differ.
        SamplingParams checks every range; its error names its own field, which `api_names`
        maps to the request's (e.g. chat's `top_logprobs` is SamplingParams' `logprobs`)."""
        seed = request.seed
        if seed is not None and SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            seed = (seed + choice) % SEED_RANGE[1]  # the same 64-bit generator state
        defaults = self.sampling_defaults
        try:
            params = SamplingParams(
                temperature=defaults.temperature if request.temperature is None
                else request.temperature,
                top_p=defaults.top_p if request.top_p is None else request.top_p,
                top_k=(defaults.top_k if request.top_k is None
                       else request.top_k if request.top_k != 0 else -1),
                seed=seed, min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
                stop=[] if request.stop is None else request.stop,
                stop_token_ids=request.stop_token_ids or [],
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=(defaults.repetition_penalty
                                    if request.repetition_penalty is None
                                    else request.repetition_penalty),
                logit_bias=_token_biases(request.logit_bias), **kwargs)
            params.check_vocab(self.vocab_size)
        except SamplingParamsError as e:
            name = api_names.get(e.field, e.field)
            raise APIError(400, f"{name} {e.reason}", name) from e
        return params

    # -- running them --------------------------------------------------------------------------

    async def respond(self, raw_request: Request, requests: list[EngineRequest],
                      prompt_param: str, stream: bool,
                      events: Callable[[ClientStream, list[RequestOutput]], AsyncIterator[str]],
                      response: Callable[[dict[str, RequestOutput]], BaseModel],
                      ending: StreamEnding = _DONE_ENDING,
                      constraint: Constraint | None = None) -> Response:
        """Submit, wait for the engine's first outputs, then stream `events` (ended as
        `ending` says) or answer with `response` of the final outputs (by request id). The
        client's share of the engine (`limiter`) is held until the response ends."""
        release = self.limiter.acquire(client_of(raw_request.scope), len(requests))
        try:
            started = await self._start(raw_request, requests, prompt_param,
                                        "structured_outputs" if constraint is None
                                        else constraint.param, release)
        except BaseException:
            release()
            raise
        if started is None:
            return Response(status_code=CLIENT_CLOSED)
        client_stream, first = started
        if stream:
            return sse_response(client_stream, events(client_stream, first), ending)
        finals = await self._finish(client_stream, first, len(requests))
        if finals is None:
            return Response(status_code=CLIENT_CLOSED)
        return Response(response(finals).model_dump_json(), media_type="application/json")

    async def stream_events(self, stream: ClientStream, first: list[RequestOutput],
                            choices: dict[str, C],
                            chunk: Callable[[RequestOutput, C], str | None],
                            usage_chunk: Callable[[list[RequestOutput]], str] | None
                            ) -> AsyncIterator[str]:
        """The streaming loop of both endpoints: once a choice has gathered `stream_interval`
        new tokens (or finished), `chunk` makes its event (None: nothing to send yet); at the
        end comes `usage_chunk`'s event, if asked for."""
        finals: list[RequestOutput] = []
        outputs: list[RequestOutput] | None = first
        while outputs is not None:
            for output in outputs:
                check_failed(output, stream.constraint_param)
                choice = choices[output.request_id]
                if (not output.finished
                        and choice.progress.pending(output.outputs[0]) < self.stream_interval):
                    continue
                if output.finished:
                    finals.append(output)
                event = chunk(output, choice)
                if event is not None:
                    yield event
            outputs = await anext(stream, None)
        if usage_chunk is not None and len(finals) == len(choices):
            yield usage_chunk(finals)

    async def _start(self, raw_request: Request, requests: list[EngineRequest],
                     prompt_param: str, constraint_param: str, on_close: Callable[[], None]
                     ) -> tuple[ClientStream, list[RequestOutput]] | None:
        """Submit and wait for the engine's first outputs; None if the client left first.
        Raises what the status should say: APIError(400) for a prompt the engine can never
        run or a constraint that failed, RequestRejectedError (503) from admission control,
        EngineDeadError (503)."""
        stream = ClientStream(self.engine.submit(requests), raw_request, constraint_param,
                              on_close)
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
        try:
            for output in first:  # a request that failed at once: its status, not an event
                check_failed(output, constraint_param)
        except APIError:
            stream.close()
            raise
        return stream, first

    @staticmethod
    async def _finish(stream: ClientStream, first: list[RequestOutput], num_requests: int
                      ) -> dict[str, RequestOutput] | None:
        """The final output of every request; None if the client left first. A request the
        engine failed is a 500 (for this HTTP request only)."""
        finals: dict[str, RequestOutput] = {}
        try:
            outputs: list[RequestOutput] | None = first
            while outputs is not None:
                for output in outputs:
                    if output.finished:
                        check_failed(output, stream.constraint_param)
                        finals[output.request_id] = output
                outputs = await anext(stream, None)
        finally:
            stream.close()
        return finals if len(finals) == num_requests else None



def check_failed(output: RequestOutput, constraint_param: str = "structured_outputs") -> None:
    """Raise what a failed output answers: the client's constraint is a 400 naming the field
    that carried it; anything else a 500 (the engine logged why)."""
    if output.error is None:
        return
    if output.error.startswith(GRAMMAR_ERROR_PREFIX):  # the client's constraint, not the server
        reason = output.error.removeprefix(GRAMMAR_ERROR_PREFIX)
        raise APIError(400, f"{constraint_param}: {reason}", constraint_param)
    raise APIError(500, INTERNAL_ERROR, type_="internal_server_error")


def usage(finals: list[RequestOutput], num_prompt_tokens: int, num_cached_tokens: int = 0
          ) -> UsageInfo:
    completion = sum(len(o.outputs[0].token_ids) for o in finals)
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                     total_tokens=num_prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias, whose keys are token ids written as strings."""
    try:
        return {int(token): bias for token, bias in (logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers)",
                       "logit_bias") from None
