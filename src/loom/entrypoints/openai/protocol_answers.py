"""What the server answers on the OpenAI wire format: completion and chat responses, their
stream chunks, usage and logprobs, shaped the way the official clients parse them (the requests
are protocol.py's)."""

from __future__ import annotations

import time
from typing import Any, Generic, Literal, TypeVar

from pydantic import Field, model_serializer

from loom.entrypoints.openai.protocol import OpenAIModel


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


LogprobsT = TypeVar("LogprobsT")
ChoiceT = TypeVar("ChoiceT")


class AnswerChoice(OpenAIModel, Generic[LogprobsT]):
    """What every choice carries besides its text, message or delta (which a subclass adds)."""

    index: int
    logprobs: LogprobsT | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Answer(OpenAIModel, Generic[ChoiceT]):
    """The envelope of every completion and chat answer, whole or a stream's chunk (a
    subclass names its `object`; a stream's chunks all carry the first one's `created`)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChoiceT]
    usage: UsageInfo | None = None


class OnlySet(OpenAIModel):
    """A stream delta's part: it carries only what changed, as OpenAI sends it (the fields
    that are None are left out)."""

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(AnswerChoice[CompletionLogprobs]):
    text: str


class CompletionResponse(Answer[CompletionChoice]):
    """/v1/completions' answer, and each chunk of its stream (OpenAI's are the same object)."""

    object: Literal["text_completion"] = "text_completion"


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(OpenAIModel):
    name: str
    arguments: str


class ResponseToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # --reasoning-parser: the answer's <think> part
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class ChatChoice(AnswerChoice[ChatLogprobs]):
    message: AssistantMessage


class ChatCompletionResponse(Answer[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo


class DeltaFunctionCall(OnlySet):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OnlySet):
    """A piece of a streamed tool call: the first carries id, type and name, the rest
    pieces of the arguments; `index` says which call they belong to."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OnlySet):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(AnswerChoice[ChatLogprobs]):
    delta: DeltaMessage


class ChatCompletionChunk(Answer[ChatStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
