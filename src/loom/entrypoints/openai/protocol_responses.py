"""OpenAI's Responses API (POST /v1/responses) on the wire, as pydantic models: the request,
read into the chat request it amounts to, and the response and its output items.

What loom takes: `input` as text or a list of items (messages with text content, the
`function_call` items of an earlier answer and the `function_call_output` items that answer
them), `instructions`, `max_output_tokens`, `temperature`, `top_p`, function `tools`,
`tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
`include: ["message.output_text.logprobs"]` and `top_logprobs` (either asks for logprobs),
`stream`, `store` and `previous_response_id` (the conversation of a response this server
kept, continued by this request's input: response_store.py). `background` is a 400 naming
the field: loom answers in the foreground only. As on the other endpoints, vLLM's
`ignore_eos` extension (which benchmark clients send for fixed output lengths) is taken.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field

from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    OpenAIModel,
    OpenAIRequest,
    RequestBody,
    ResponseFormat,
    ToolCall,
)
from loom.model.generation_config import LOOM_DEFAULTS, SamplingDefaults

# -- the request -------------------------------------------------------------------------------

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # what `include` names to get them


class InputContentPart(OpenAIRequest):
    type: str
    text: str | None = None


class InputItem(OpenAIRequest):
    """One entry of `input`: a message (`type` "message", or no type) or a function call
    and its output. Which fields each kind needs is checked in `chat_messages`, so that the
    error can say which entry lacks what."""

    # "reasoning": an earlier answer's reasoning item, which clients send back; templates
    # drop earlier turns' reasoning, and so does loom
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None


class FunctionTool(OpenAIRequest):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIRequest):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIRequest):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    store: bool | None = None
    # OpenAI's limits: what a response keeps and echoes stays small
    metadata: dict[Annotated[str, Field(max_length=64)],
                   Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=512)
    previous_response_id: str | None = None
    background: bool | None = None
    ignore_eos: bool = False  # vLLM's extension

    def chat_request(self, earlier: list[ChatMessage] | None = None) -> ChatCompletionRequest:
        """The chat completion this request asks for: `instructions` as a system turn, then
        the `earlier` turns (those of the response named by previous_response_id), then
        `input`. A 400 naming the field for what loom cannot do."""
        if self.background:
            raise APIError(400, "background: this server answers in the foreground only",
                           "background")
        turns = chat_messages(self.input)
        if not turns:
            raise APIError(400, "input must not be empty", "input")
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions \
            else []
        messages = [*system, *(earlier or []), *turns]
        logprobs = LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None
        return ChatCompletionRequest(
            messages=messages, max_completion_tokens=self.max_output_tokens,
            logprobs=logprobs, top_logprobs=self.top_logprobs if logprobs else None,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream,
            tools=[ChatTool(function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters,
                strict=t.strict)) for t in self.tools] if self.tools else None,
            tool_choice=(NamedToolChoice(function=NamedFunction(name=self.tool_choice.name))
                         if isinstance(self.tool_choice, FunctionToolChoice)
                         else self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls, ignore_eos=self.ignore_eos,
            response_format=_response_format(self.text))


def chat_messages(given: str | list[InputItem]) -> list[ChatMessage]:
    """`input` as chat messages: text is one user turn; a function call joins the assistant
    turn just before it (a turn of its own otherwise); its output is a tool turn."""
    if isinstance(given, str):
        return [ChatMessage(role="user", content=given)]
    messages: list[ChatMessage] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if item.type == "reasoning":
            continue
        if item.type == "message":
            if item.role is None or item.content is None:
                raise APIError(400, f"{where}: a message needs role and content", "input")
            messages.append(ChatMessage(role=item.role, content=_text(item.content, where)))
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise APIError(400, f"{where}: a function_call needs call_id, name and "
                               "arguments", "input")
            call = ToolCall(id=item.call_id,
                            function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            if item.call_id is None or item.output is None:
                raise APIError(400, f"{where}: a function_call_output needs call_id and "
                               "output", "input")
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_text(item.output, where)))
    return messages


def _text(content: str | list[InputContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    for part in content:
        if part.type not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}: content part of type {part.type!r} is not "
                           "supported (text only)", "input")
        if part.text is None:
            raise APIError(400, f"{where}: a content part of type {part.type!r} needs text",
                           "input")
    return "".join(part.text or "" for part in content)


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if fmt.type == "json_schema" and fmt.json_schema is None:
        raise APIError(400, "text.format: type json_schema needs schema", "text")
    schema = (JsonSchemaFormat.model_validate({"name": fmt.name, "schema": fmt.json_schema,
                                               "strict": fmt.strict})
              if fmt.type == "json_schema" else None)
    return ResponseFormat(type=fmt.type, json_schema=schema)


# -- the response ------------------------------------------------------------------------------


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageItem(OpenAIModel):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIModel):
    """The answer's reasoning (--reasoning-parser), before its message and calls."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponsesUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIModel):
    """A response as OpenAI's clients read it; the request's settings are echoed back."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None,
                                                               "summary": None})
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponsesUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False

    @classmethod
    def starting(cls, response_id: str, request: ResponsesRequest, model: str,
                 stored: bool = False, defaults: SamplingDefaults = LOOM_DEFAULTS
                 ) -> ResponseObject:
        """The response before its output: status in_progress, the request's settings
        (`defaults` for the sampling it leaves unset); `stored`: whether the server keeps
        it once finished."""
        return cls(
            id=response_id, status="in_progress", instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, model=model,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=defaults.temperature if request.temperature is None
            else request.temperature,
            top_p=defaults.top_p if request.top_p is None else request.top_p,
            text=(request.text.model_dump(by_alias=True, exclude_none=True)
                  if request.text is not None and request.text.format is not None
                  else {"format": {"type": "text"}}),
            tool_choice=(request.tool_choice.model_dump()
                         if isinstance(request.tool_choice, FunctionToolChoice)
                         else request.tool_choice or "auto"),
            tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
            user=request.user, metadata=request.metadata or {},
            previous_response_id=request.previous_response_id,
            store=stored)


class DeletedResponse(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
