"""The OpenAI wire format (plus the vLLM extensions benchmark tools send), as pydantic models.

Requests ignore unknown fields, as OpenAI-compatible servers do, but reject wrong types with
the field's name: strictly (a JSON `true` is no integer, "5" is no number). Ranges of the
sampling fields are checked once, by `SamplingParams`; only what is HTTP's alone (`n`, a prompt
that is not empty, text that is valid Unicode, the chat roles) is checked here. What the server
answers is protocol_answers.py's (the model list, /tokenize's answers and the error body are
here).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from loom.model.chat_template import RESERVED_VARIABLES
from loom.sampling import valid_unicode


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIRequest(OpenAIModel):
    model_config = ConfigDict(extra="ignore", strict=True)


LONE_SURROGATE = "lone_surrogate"  # the pydantic error type of RequestBody's check


class RequestBody(OpenAIRequest):
    """A whole request body. JSON may carry lone surrogates ("\\ud800") in any string,
    which no tokenizer and no UTF-8 response can: the body is checked once, every string and
    key, whichever field it is in (ignored ones too, as a tool's description or a metadata
    value end up in a chat template or an echoed response)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        where = lone_surrogate_path(body)
        if where is not None:
            raise PydanticCustomError(
                LONE_SURROGATE, "{field}: must be valid Unicode (it holds a lone surrogate "
                "such as \\ud800)", {"field": ".".join(map(str, where)) or "request body"})
        return body


def lone_surrogate_path(value: Any) -> list[str | int] | None:
    """The path to the first string (or object key) in a JSON value that holds a lone
    surrogate; None if there is none. Iterative: a body may nest deeper than Python recurses."""
    stack: list[tuple[list[str | int], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not valid_unicode(item):
                return path
        elif isinstance(item, dict):
            for key in reversed(list(item)):
                if isinstance(key, str) and not key.isascii() and not valid_unicode(key):
                    return path
                if isinstance(item[key], (str, dict, list)):
                    stack.append(([*path, key], item[key]))
        elif isinstance(item, list):
            stack.extend(([*path, i], v) for i, v in reversed(list(enumerate(item)))
                         if isinstance(v, (str, dict, list)))
    return None


# -- requests ------------------------------------------------------------------------------------


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


class JsonSchemaFormat(OpenAIRequest):
    name: str = "response"
    description: str | None = None
    # `schema` is a BaseModel attribute: the wire name is taken through an alias
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIRequest):
    """vLLM's `structured_outputs` object: exactly one of these is set."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(RequestBody):
    """Fields completions and chat share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off (vLLM's extension)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI's) -> bias
    # vLLM extensions that benchmark tools send
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo
                             ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("is only allowed when stream is true (as OpenAI's)")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


# Engine requests (prompts x n) one completions request may make. The server builds them all
# before the first step, on the event loop every client shares: 2000 prompts x n=128 held
# /health for 12 s, and the 4 MiB body limit lets a batch of a million prompts through.
MAX_SEQUENCES_PER_REQUEST = 8192


class CompletionRequest(SamplingRequest):
    # A string, token ids, or a batch of either (each prompt gets its own n choices).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # 0: score the prompt only (with echo)
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if any(len(p) == 0 for p in _as_batch(prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _not_too_many(cls, prompt: Any, info: ValidationInfo) -> Any:
        """`n` is validated before `prompt` (it is declared first), so it is in info.data."""
        num_prompts, n = len(_as_batch(prompt)), info.data.get("n", 1)
        if num_prompts * n > MAX_SEQUENCES_PER_REQUEST:
            raise ValueError(
                f"{num_prompts} prompts x n={n} make {num_prompts * n} sequences; one request "
                f"may make at most {MAX_SEQUENCES_PER_REQUEST} (send the batch in several "
                "requests)")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: one entry per prompt."""
        return _as_batch(self.prompt)


def _as_batch(prompt: Any) -> list[Any]:
    single = isinstance(prompt, str) or not prompt or isinstance(prompt[0], int)
    return [prompt] if single else list(prompt)


class ContentPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIRequest):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIRequest):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(OpenAIRequest):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateKwargs(OpenAIRequest):
    """vLLM's `chat_template_kwargs`: variables of the chat template, e.g.
    {"enable_thinking": false}; not those the server renders it with."""

    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_servers(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_VARIABLES & set(kwargs or {}))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is set by the server, not by the template's "
                             "kwargs")
        return kwargs


class ChatCompletionRequest(SamplingRequest, ChatTemplateKwargs):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # true: `required` may make several calls


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "loom"
    root: str
    max_model_len: int


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestBody, ChatTemplateKwargs):
    """vLLM's /tokenize: a `prompt`, or `messages` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ChatTool] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
