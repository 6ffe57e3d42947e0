"""POST /v1/chat/completions: messages through the model's own chat template, n choices,
streamed (a role chunk, then content deltas) or not, with per-token logprobs, structured
outputs and tool calls.

Reasoning: with `--reasoning-parser` (reasoning.py) the answer's `<think>` part goes to
`reasoning_content` (streamed as `delta.reasoning_content`), and tool calls are read from the
rest; an answer constrained from its first token (structured outputs, tool_choice required or
a named function) reasons only where its constraint writes `<think>` first (a regex or
grammar can), whatever the prompt opened. `chat_template_kwargs` (e.g.
`{"enable_thinking": false}`) are variables of the chat template.

Tool calls: with `tool_choice` auto the answer is parsed by the model family's tool-call
parser (hermes, llama3_json, mistral, phi4_mini); `required` and a named function constrain
the answer with a JSON schema, so their arguments always parse. A streamed answer sends
content as soon as it cannot be the start of a call, and each call, whole, once it is complete
(a named function's arguments stream as they come).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response

from loom.engine.async_engine import EngineRequest
from loom.entrypoints.openai.chat_messages import chat_prompt_ids
from loom.entrypoints.openai.constraints import Constraint
from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from loom.entrypoints.openai.protocol_answers import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
    TopLogprob,
)
from loom.entrypoints.openai.reasoning import ReasoningParser, reasoning_parser
from loom.entrypoints.openai.serving import Choice, ClientStream, OpenAIServing, usage
from loom.entrypoints.openai.sse import sse
from loom.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ParsedToolCall,
    ToolParser,
    parser_name_for_template,
)
from loom.entrypoints.openai.tool_parsers.base import ExtractedToolCalls
from loom.entrypoints.openai.tool_parsers.tool_choice import ToolUse
from loom.outputs import CompletionOutput, RequestOutput, TokenLogprob


@dataclass
class ChatChoiceState(Choice):
    """A streamed chat choice also tracks the text it has sent as content, and its calls."""

    content_sent: int = 0
    reasoning_sent: int = 0
    named_call: ParsedToolCall | None = None  # a named function: its id, sent first
    calls: list[ParsedToolCall] = field(default_factory=list)


@dataclass
class ChatPlan:
    """A chat request made ready to run (ChatServing.plan)."""

    tool_use: ToolUse
    num_prompt_tokens: int
    requests: list[EngineRequest]
    choices: dict[str, ChatChoiceState]  # by engine request id
    constraint: Constraint | None = None
    # Whether the answer begins inside its reasoning; None: no reasoning to split out
    reasoning_inside: bool | None = None


@dataclass(frozen=True)
class ChatFields:
    """What an API calls the chat request's fields, so that an error names the one the client
    sent (the Responses API sends `input`, `text` and `max_output_tokens`). `max_tokens` None:
    whichever of max_tokens and max_completion_tokens the request used."""

    messages: str = "messages"
    response_format: str = "response_format"
    max_tokens: str | None = None


class ChatServing(OpenAIServing):
    def __init__(self, *args: Any, tool_call_parser: str | None = None,
                 special_tokens_in_content: bool = False, reasoning: str = "none",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        name = tool_call_parser or parser_name_for_template(self.tokenizer.chat_template)
        self.tool_parser: ToolParser = TOOL_PARSERS[name]()
        self.special_tokens_in_content = special_tokens_in_content
        self.reasoning: ReasoningParser | None = reasoning_parser(reasoning)

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"
        plan = await self.plan(request, chat_id, raw_request)
        created = int(time.time())

        def events(stream: ClientStream, first: list[RequestOutput]) -> AsyncIterator[str]:
            return self._events(request, plan, chat_id, created, stream, first)

        def response(finals: dict[str, RequestOutput]) -> ChatCompletionResponse:
            outputs = list(finals.values())
            return ChatCompletionResponse(
                id=chat_id, created=created, model=self.model_name,
                choices=[self.choice(request, plan, finals[rid].outputs[0], choice.index)
                         for rid, choice in plan.choices.items()],
                usage=usage(outputs, plan.num_prompt_tokens, outputs[0].num_cached_tokens))

        return await self.respond(raw_request, plan.requests, "messages", request.stream,
                                  events, response, constraint=plan.constraint)

    async def plan(self, request: ChatCompletionRequest, request_id: str, raw_request: Request,
                   fields: ChatFields = ChatFields()) -> ChatPlan:
        """The request made ready to run (errors name the fields as `fields` says): its tool
        use, its prompt through the chat template, one engine request per choice."""
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        tool_use = _tool_use(request)
        constraint = await self._structured(request, tool_use, fields.response_format,
                                            raw_request)
        prompt, token_ids = await asyncio.to_thread(  # long chats take a while
            self.render, request.messages, tool_use.tools, fields.messages,
            request.chat_template_kwargs)
        budget_param = fields.max_tokens or ("max_completion_tokens"
                                             if request.max_completion_tokens is not None
                                             else "max_tokens")
        budget = (request.max_tokens if request.max_completion_tokens is None
                  else request.max_completion_tokens)
        max_tokens = self.max_tokens(budget, len(token_ids), fields.messages, budget_param)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        api_names = {"max_tokens": budget_param, "logprobs": "top_logprobs"}
        requests = [EngineRequest(f"{request_id}-{i}", token_ids,
                                  self.sampling_params(request, i, api_names,
                                                       max_tokens=max_tokens, logprobs=logprobs,
                                                       structured_outputs=constraint
                                                       and constraint.params),
                                  request.priority)
                    for i in range(request.n)]
        constrained = constraint is not None
        return ChatPlan(tool_use, len(token_ids), requests,
                        {r.request_id: ChatChoiceState(i) for i, r in enumerate(requests)},
                        constraint,
                        None if self.reasoning is None
                        else False if constrained else self.reasoning.starts_inside(prompt))

    async def _structured(self, request: ChatCompletionRequest, tool_use: ToolUse,
                          format_param: str, raw_request: Request) -> Constraint | None:
        """The answer's constraint: the one tool_choice implies, or the request's own."""
        asked = await self.structured_outputs(request, raw_request, format_param)
        schema = tool_use.schema()
        if schema is None:
            return asked
        if asked is not None:
            raise APIError(400, f"tool_choice {tool_use.mode!r} cannot be combined with "
                           f"{format_param} or structured outputs", "tool_choice")
        return await self.checked_constraint("tools", {"json": schema},  # their parameters
                                             raw_request)

    def render(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
               param: str = "messages", template_kwargs: dict[str, Any] | None = None
               ) -> tuple[str, list[int]]:
        """The conversation (and tools) through the model's chat template, as text and token
        ids; a conversation the template refuses is a 400 naming `param`."""
        return chat_prompt_ids(self.tokenizer, messages, tools, add_generation_prompt=True,
                               param=param, template_kwargs=template_kwargs,
                               special_tokens_in_content=self.special_tokens_in_content)

    def reasoning_tokens(self, plan: ChatPlan, completion: CompletionOutput) -> int:
        """How many of the answer's tokens are its reasoning (the Responses API's usage)."""
        if plan.reasoning_inside is None or self.reasoning is None:
            return 0
        return self.reasoning.token_count(self.tokenizer.decode, completion.token_ids,
                                          plan.reasoning_inside)

    def calls(self, tool_use: ToolUse, text: str) -> ExtractedToolCalls:
        """The answer's tool calls and its remaining content."""
        if tool_use.mode in ("required", "named"):
            return ExtractedToolCalls(None, tool_use.enforced_calls(text))
        if tool_use.mode == "auto":
            return self.tool_parser.extract(text, tool_use.tools)
        return ExtractedToolCalls(text, [])

    def choice(self, request: ChatCompletionRequest, plan: ChatPlan,
               completion: CompletionOutput, index: int) -> ChatChoice:
        """A finished choice: its reasoning, content and tool calls, logprobs, why it ended."""
        tool_use, reasoning, text = plan.tool_use, None, completion.text
        if plan.reasoning_inside is not None and self.reasoning is not None:
            split = self.reasoning.split(text, plan.reasoning_inside)
            reasoning, text = split.reasoning, split.content
        found = self.calls(tool_use, text)
        content = found.content if found.calls or tool_use.enforced else text
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=(content or None) if reasoning is not None
                                     else content, reasoning_content=reasoning,
                                     tool_calls=[_response_call(c) for c in found.calls]),
            logprobs=self.logprobs(request, completion.token_ids, completion.logprobs),
            finish_reason=_finish_reason(tool_use, completion, bool(found.calls)),
            stop_reason=completion.stop_reason)

    async def _events(self, request: ChatCompletionRequest, plan: ChatPlan, chat_id: str,
                      created: int, stream: ClientStream, first: list[RequestOutput]
                      ) -> AsyncIterator[str]:
        tool_use, num_prompt_tokens = plan.tool_use, plan.num_prompt_tokens

        def chunk(stream_choices: list[ChatStreamChoice], **extra: object) -> str:
            return sse(ChatCompletionChunk(id=chat_id, created=created, model=self.model_name,
                                           choices=stream_choices, **extra))

        def delta(output: RequestOutput, choice: ChatChoiceState) -> str | None:
            completion = output.outputs[0]
            logprobs = self.advance(request, choice, completion)
            message = self.delta_message(plan, choice, completion.text, output.finished)
            if not output.finished and message is None and logprobs is None:
                return None  # tokens that are no text yet (half a UTF-8 char, a stop prefix)
            so_far = (usage([output], num_prompt_tokens, output.num_cached_tokens)
                      if request.continuous_usage else None)
            return chunk([ChatStreamChoice(
                index=choice.index, delta=message or DeltaMessage(content=""),
                logprobs=logprobs,
                finish_reason=(_finish_reason(tool_use, completion, bool(choice.calls))
                               if output.finished else None),
                stop_reason=completion.stop_reason)], usage=so_far)

        for choice in plan.choices.values():
            yield chunk([ChatStreamChoice(index=choice.index,
                                          delta=DeltaMessage(role="assistant", content=""))])

        def usage_chunk(finals: list[RequestOutput]) -> str:
            return chunk([], usage=usage(finals, num_prompt_tokens, finals[0].num_cached_tokens))

        async for event in self.stream_events(stream, first, plan.choices, delta,
                                              usage_chunk if request.include_usage else None):
            yield event

    def delta_message(self, plan: ChatPlan, choice: ChatChoiceState, text: str,
                      finished: bool) -> DeltaMessage | None:
        """What a streamed choice can send now of its answer `text` (None: nothing yet):
        new reasoning first, then what the content (after the reasoning) adds."""
        if plan.reasoning_inside is None or self.reasoning is None:
            return self._content_message(plan.tool_use, choice, text, finished)
        split = self.reasoning.split(text, plan.reasoning_inside, finished)
        reasoning = (split.reasoning or "")[choice.reasoning_sent:]
        choice.reasoning_sent += len(reasoning)
        message = self._content_message(plan.tool_use, choice, split.content, finished)
        if not reasoning:
            return message
        return (message or DeltaMessage()).model_copy(update={"reasoning_content": reasoning})

    def _content_message(self, tool_use: ToolUse, choice: ChatChoiceState, text: str,
                         finished: bool) -> DeltaMessage | None:
        if tool_use.mode == "named":
            return self._named_delta(tool_use, choice, text)
        if tool_use.mode == "none":
            return _content_delta(choice, text, len(text))
        if not finished:
            sure = 0 if tool_use.mode == "required" else self.tool_parser.content_prefix(text)
            return _content_delta(choice, text, sure)
        found = self.calls(tool_use, text)
        if not found.calls:  # an enforced answer cut short is no content either
            return None if tool_use.enforced else _content_delta(choice, text, len(text))
        choice.calls = found.calls
        content = found.content or ""
        return DeltaMessage(
            content=content[choice.content_sent:] or None,
            tool_calls=[DeltaToolCall(index=i, id=c.id, type="function",
                                      function=DeltaFunctionCall(name=c.name,
                                                                 arguments=c.arguments))
                        for i, c in enumerate(found.calls)])

    @staticmethod
    def _named_delta(tool_use: ToolUse, choice: ChatChoiceState, text: str) -> DeltaMessage | None:
        """A named function's arguments are the answer itself: they stream as they come,
        after a first piece that carries the call's id and name."""
        new = text[choice.content_sent:]
        choice.content_sent = len(text)
        if choice.named_call is None:
            choice.named_call = ParsedToolCall(tool_use.named or "", "")
            choice.calls = [choice.named_call]
            piece = DeltaToolCall(index=0, id=choice.named_call.id, type="function",
                                  function=DeltaFunctionCall(name=tool_use.named, arguments=new))
        elif new:
            piece = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new))
        else:
            return None
        return DeltaMessage(tool_calls=[piece])

    def advance(self, request: ChatCompletionRequest, choice: ChatChoiceState,
                completion: CompletionOutput) -> ChatLogprobs | None:
        """Move the choice past what it has sent (stream_interval counts from there); the
        logprobs of the tokens since, where the request asks for them."""
        _, start = choice.progress.advance(completion)
        return self.logprobs(request, completion.token_ids[start:],
                             (completion.logprobs or [])[start:])

    def logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                 entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if not request.logprobs or entries is None:
            return None

        def top(token_id: int, logprob: float) -> TopLogprob:
            return TopLogprob(token=self.tokenizer.id_to_token(token_id), logprob=logprob,
                              bytes=list(self.tokenizer.token_bytes(token_id)))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**top(token_id, entry.logprob).model_dump(),
                             top_logprobs=[top(t, lp) for t, lp in entry.top])
            for token_id, entry in zip(token_ids, entries)])


def _tool_use(request: ChatCompletionRequest) -> ToolUse:
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
    choice = request.tool_choice
    try:
        return ToolUse.of(tools, choice if isinstance(choice, str) or choice is None
                          else choice.model_dump(), request.parallel_tool_calls is True)
    except ValueError as e:  # its message starts with the field it names
        field = str(e).split(":", 1)[0]
        raise APIError(400, str(e), field if field == "tools" else "tool_choice") from e


def _content_delta(choice: ChatChoiceState, text: str, sure: int) -> DeltaMessage | None:
    new = text[choice.content_sent:sure]
    if not new:
        return None
    choice.content_sent = sure
    return DeltaMessage(content=new)


def _response_call(call: ParsedToolCall) -> ResponseToolCall:
    return ResponseToolCall(id=call.id, function=ResponseFunctionCall(name=call.name,
                                                                     arguments=call.arguments))


def _finish_reason(tool_use: ToolUse, completion: CompletionOutput, called: bool) -> str | None:
    """"tool_calls" when the model called a tool and its answer ended there (not cut by
    max_tokens), whether it chose to (auto) or had to (required, a named function)."""
    if called and tool_use.mode != "none" and completion.finish_reason == "stop":
        return "tool_calls"
    return completion.finish_reason
