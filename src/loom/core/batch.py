"""The plain data that crosses between scheduler and model runner, one step at a time."""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.sampling import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: feed `token_ids` at positions starting at
    `start_position`, reading and writing KV through `block_ids`."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sampling_params: SamplingParams
    sample: bool  # this chunk reaches the last known token, so a new token is sampled
    prompt_token_ids: list[int]  # scoring targets when prompt logprobs are asked for
    # Fixed-batch padding: compute as usual but write K/V to a scratch slot and discard the
    # result (the request has already finished).
    padding: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous step: the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


TopLogprobs = list[tuple[int, float]]


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: TopLogprobs


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request id -> (first prompt position covered, logprobs of those prompt tokens)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
