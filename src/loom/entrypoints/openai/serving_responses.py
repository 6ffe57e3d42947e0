"""POST /v1/responses: OpenAI's Responses API, which agent frameworks (the OpenAI Agents SDK,
Codex-style clients) speak by default. A request is read into the chat request it amounts to
(protocol_responses) and runs on the chat path: the same template, tool calls, structured
outputs and streaming deltas. Only the shape differs: the answer is a list of output items (a
message, then the function calls), and a stream is typed events, each numbered:

    response.created, response.in_progress
    reasoning:    output_item.added, reasoning_text.delta ..., reasoning_text.done,
                  output_item.done  (with --reasoning-parser, before the rest)
    per message:  output_item.added, content_part.added, output_text.delta ...,
                  output_text.done, content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta ...,
                  function_call_arguments.done, output_item.done
    response.completed (or response.incomplete: the answer reached max_output_tokens)

An error after the stream began is an `error` event; there is no `data: [DONE]`. A finished
response is kept (unless the request says `store: false`) for a later request's
`previous_response_id` and for GET / DELETE /v1/responses/{id} (response_store.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request, Response

from loom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ErrorResponse,
    FunctionCall,
    ToolCall,
)
from loom.entrypoints.openai.protocol_answers import ChatChoice, ChatTokenLogprob, DeltaToolCall
from loom.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponsesUsage,
)
from loom.entrypoints.openai.response_store import ResponseStore
from loom.entrypoints.openai.serving import ClientStream
from loom.entrypoints.openai.serving_chat import ChatChoiceState, ChatFields, ChatPlan, ChatServing
from loom.entrypoints.openai.sse import StreamEnding, sse_json
from loom.outputs import RequestOutput

RESPONSES_FIELDS = ChatFields(messages="input", response_format="text",
                              max_tokens="max_output_tokens")


class ResponsesServing:
    """/v1/responses on the chat endpoint's serving: its template, tool parser, engine."""

    def __init__(self, chat: ChatServing, store: ResponseStore) -> None:
        self.chat, self.store = chat, store

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        chat, response_id = self.chat, f"resp_{uuid.uuid4().hex}"
        earlier = ([] if request.previous_response_id is None else
                   self.store.get(request.previous_response_id,
                                  "previous_response_id").conversation)
        chat_request = request.chat_request(earlier)
        plan = await chat.plan(chat_request, response_id, raw_request, RESPONSES_FIELDS)
        conversation = chat_request.messages[1 if request.instructions else 0:]
        stored = request.store is not False and self.store.capacity > 0
        keep = self._keeper(stored, conversation)
        events = ResponseEvents(
            ResponseObject.starting(response_id, request, chat.model_name, stored,
                                    chat.sampling_defaults), keep,
            lambda output: chat.reasoning_tokens(plan, output.outputs[0]))

        def stream(client: ClientStream, first: list[RequestOutput]) -> AsyncIterator[str]:
            return self._events(chat_request, plan, events, client, first)

        def response(finals: dict[str, RequestOutput]) -> ResponseObject:
            (output,) = finals.values()
            choice = chat.choice(chat_request, plan, output.outputs[0], 0)
            return keep(events.finished(_output_items(choice), output, plan.num_prompt_tokens))

        return await chat.respond(raw_request, plan.requests, "input", request.stream, stream,
                                  response, StreamEnding(events.error, last=""),
                                  plan.constraint)

    def _keeper(self, stored: bool, conversation: list[ChatMessage]
                ) -> Callable[[ResponseObject], ResponseObject]:
        """What a finished response goes through: kept with its conversation and answer
        when `stored`."""
        def keep(response: ResponseObject) -> ResponseObject:
            if stored:
                self.store.put(response, [*conversation, _answer_turn(response.output)])
            return response
        return keep

    def retrieve(self, response_id: str) -> ResponseObject:
        return self.store.get(response_id).response

    def delete(self, response_id: str) -> DeletedResponse:
        self.store.delete(response_id)
        return DeletedResponse(id=response_id)

    async def _events(self, request: ChatCompletionRequest, plan: ChatPlan,
                      events: ResponseEvents, stream: ClientStream, first: list[RequestOutput]
                      ) -> AsyncIterator[str]:
        def piece(output: RequestOutput, choice: ChatChoiceState) -> str | None:
            completion = output.outputs[0]
            logprobs = self.chat.advance(request, choice, completion)
            if logprobs is not None:  # tokens that are no text yet wait for theirs
                events.hold(logprobs.content or [])
            message = self.chat.delta_message(plan, choice, completion.text, output.finished)
            sent = []
            if message is not None and message.reasoning_content:
                sent += events.reasoning(message.reasoning_content)
            if message is not None and message.content:
                sent += events.text(message.content)
            for call in (message.tool_calls or []) if message is not None else []:
                sent += events.call_piece(call)
            if output.finished:
                sent += events.finish(output, plan.num_prompt_tokens)
            return "".join(sent) or None

        yield "".join(events.start())
        async for event in self.chat.stream_events(stream, first, plan.choices, piece, None):
            yield event


def _output_items(choice: ChatChoice) -> list[OutputItem]:
    """A finished answer's output: its reasoning, if any, its text as a message (also when it
    is empty and made no call), then its calls."""
    message, calls = choice.message, choice.message.tool_calls
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    items: list[OutputItem] = []
    if message.reasoning_content is not None:
        items.append(ReasoningItem(id=_item_id("rs"), status="completed", content=[
            ReasoningText(text=message.reasoning_content)]))
    logprobs = [] if choice.logprobs is None else _dumped(choice.logprobs.content)
    if message.content or not calls:
        items.append(MessageItem(id=_item_id("msg"), status=status, content=[
            OutputText(text=message.content or "", logprobs=logprobs)]))
    items += [FunctionCallItem(id=_item_id("fc"), status="completed", call_id=call.id,
                               name=call.function.name, arguments=call.function.arguments)
              for call in calls]
    return items


def _answer_turn(items: list[OutputItem]) -> ChatMessage:
    """A response's output as the assistant turn a later request continues from."""
    text = "".join(part.text for item in items if isinstance(item, MessageItem)
                   for part in item.content)
    calls = [ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                             arguments=item.arguments))
             for item in items if isinstance(item, FunctionCallItem)]
    return ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)


def _dumped(logprobs: list[ChatTokenLogprob] | None) -> list[dict[str, Any]]:
    """Chat's per-token logprobs as the Responses API writes them (the same fields)."""
    return [entry.model_dump() for entry in logprobs or []]


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class ResponseEvents:
    """One response's event stream, from the chat path's deltas: it opens each output item
    when its first piece comes, closes the message when a call begins (items are
    sequential), and numbers every event."""

    def __init__(self, response: ResponseObject,
                 on_finished: Callable[[ResponseObject], ResponseObject] | None = None,
                 reasoning_tokens: Callable[[RequestOutput], int] = lambda _: 0) -> None:
        self.response = response
        self.on_finished = on_finished  # given the final response (to keep it)
        self.reasoning_tokens = reasoning_tokens  # of a finished answer, for its usage
        self.sequence = 0
        self.thought: ReasoningItem | None = None
        self.message: MessageItem | None = None
        self.calls: dict[int, FunctionCallItem] = {}  # by the chat delta's call index
        self.held: list[dict[str, Any]] = []  # logprobs of tokens whose text is not sent yet

    def start(self) -> list[str]:
        snapshot = self.response.model_dump(mode="json")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def hold(self, logprobs: list[ChatTokenLogprob]) -> None:
        """Logprobs of new tokens, sent with the next text delta (or when the text closes)."""
        self.held += _dumped(logprobs)

    def reasoning(self, delta: str) -> list[str]:
        """A piece of the reasoning, which comes before any text or call."""
        sent = []
        if self.thought is None:
            self.thought = ReasoningItem(id=_item_id("rs"), status="in_progress",
                                         content=[ReasoningText(text="")])
            sent += self._add(self.thought)
        self.thought.content[0].text += delta
        sent.append(self._event("response.reasoning_text.delta", content_index=0, delta=delta,
                                **self._where(self.thought)))
        return sent

    def _close_reasoning(self, status: str) -> list[str]:
        thought = self.thought
        if thought is None or thought.status != "in_progress":
            return []
        thought.status = status  # type: ignore[assignment] - "completed" or "incomplete"
        where = self._where(thought)
        return [self._event("response.reasoning_text.done", content_index=0,
                            text=thought.content[0].text, **where),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=thought.model_dump(mode="json"))]

    def text(self, delta: str) -> list[str]:
        sent = self._close_reasoning("completed")
        sent += self._open_message() if self.message is None else []
        assert self.message is not None
        part, logprobs, self.held = self.message.content[0], self.held, []
        part.text += delta
        part.logprobs += logprobs
        sent.append(self._event("response.output_text.delta", content_index=0, delta=delta,
                                logprobs=logprobs, **self._where(self.message)))
        return sent

    def _open_message(self) -> list[str]:
        self.message = MessageItem(id=_item_id("msg"), status="in_progress")
        added = self._add(self.message)  # with no content yet: its part is added next
        self.message.content.append(OutputText(text=""))
        return [*added, self._event("response.content_part.added", content_index=0,
                                    part=OutputText(text="").model_dump(mode="json"),
                                    **self._where(self.message))]

    def call_piece(self, piece: DeltaToolCall) -> list[str]:
        sent = []
        call = self.calls.get(piece.index)
        if call is None:
            sent += self._close_reasoning("completed")
            sent += self._close_message("completed")
            call = FunctionCallItem(id=_item_id("fc"), status="in_progress",
                                    call_id=piece.id or _item_id("call"),
                                    name=piece.function.name or "", arguments="")
            self.calls[piece.index] = call
            sent += self._add(call)
        if piece.function.arguments:
            call.arguments += piece.function.arguments
            sent.append(self._event("response.function_call_arguments.delta",
                                    delta=piece.function.arguments, **self._where(call)))
        return sent

    def finish(self, output: RequestOutput, num_prompt_tokens: int) -> list[str]:
        """Close every open item, then the response itself."""
        status = "incomplete" if output.outputs[0].finish_reason == "length" else "completed"
        sent = self._close_reasoning(status)
        empty = self.message is None and not self.calls
        sent += self._open_message() if empty else []  # an empty answer is still a message
        sent += self._close_message(status)
        for call in self.calls.values():
            call.status = "completed"
            sent.append(self._event("response.function_call_arguments.done", name=call.name,
                                    arguments=call.arguments, **self._where(call)))
            sent.append(self._event("response.output_item.done", output_index=self._index(call),
                                    item=call.model_dump(mode="json")))
        done = self.finished(list(self.response.output), output, num_prompt_tokens)
        if self.on_finished is not None:
            done = self.on_finished(done)
        sent.append(self._event(f"response.{done.status}",
                                response=done.model_dump(mode="json")))
        return sent

    def finished(self, items: list[OutputItem], output: RequestOutput,
                 num_prompt_tokens: int) -> ResponseObject:
        """The response with its output and usage."""
        completion = output.outputs[0]
        length = completion.finish_reason == "length"
        return self.response.model_copy(update={
            "status": "incomplete" if length else "completed", "output": items,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if length
            else None,
            "usage": ResponsesUsage(
                input_tokens=num_prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=output.num_cached_tokens),
                output_tokens=len(completion.token_ids),
                output_tokens_details=OutputTokensDetails(
                    reasoning_tokens=self.reasoning_tokens(output)),
                total_tokens=num_prompt_tokens + len(completion.token_ids))})

    def error(self, body: ErrorResponse) -> str:
        return self._event("error", code=body.error.type, message=body.error.message,
                           param=body.error.param)

    def _close_message(self, status: str) -> list[str]:
        message = self.message
        if message is None or message.status != "in_progress":
            return []
        message.status = status  # type: ignore[assignment] - "completed" or "incomplete"
        part = message.content[0]
        part.logprobs, self.held = part.logprobs + self.held, []
        where = self._where(message)
        return [self._event("response.output_text.done", content_index=0, text=part.text,
                            logprobs=part.logprobs, **where),
                self._event("response.content_part.done", content_index=0,
                            part=part.model_dump(mode="json"), **where),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=message.model_dump(mode="json"))]

    def _add(self, item: OutputItem) -> list[str]:
        self.response.output.append(item)
        return [self._event("response.output_item.added", output_index=self._index(item),
                            item=item.model_dump(mode="json"))]

    def _index(self, item: OutputItem) -> int:
        return next(i for i, x in enumerate(self.response.output) if x is item)

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self._index(item)}

    def _event(self, type_: str, **fields: Any) -> str:
        data = json.dumps({"type": type_, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return sse_json(data, type_)
