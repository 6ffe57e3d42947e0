"""What the engine hands back to callers, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

TopLogprobs = list[tuple[int, float]]


@dataclass
class TokenLogprob:
    """A chosen token's log-probability and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: TopLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage's cached_tokens)
    error: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
