"""A request as the scheduler tracks it: tokens, progress and status. (Latency marks live
with the engine, in outputs.RequestMetrics.)"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loom.sampling import SamplingParams

if TYPE_CHECKING:
    from loom.structured.state import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(eq=False)
class Request:
    """One generation request. `num_computed_tokens` counts tokens whose KV is in the cache;
    the scheduler's only job is to close the gap to `num_tokens`.

    With async scheduling the next step is scheduled while the current one runs:
    `num_inflight_tokens` are fed to a step that has not finished yet, and
    `num_output_placeholders` tokens are being sampled by such steps (their ids are unknown
    until the step ends). Both are zero whenever no step is in flight.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()  # every id that ends generation
    priority: int = 0
    arrival_order: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # What ended it, once finished by a stop: the stop string or stop token id; None for EOS.
    stop_reason: str | int | None = None
    # Structured outputs: the request's matcher; it is scheduled only once that is compiled.
    grammar: GrammarState | None = None

    @property
    def waiting_for_grammar(self) -> bool:
        """Its grammar is still compiling (or failed to: the engine ends it)."""
        return self.grammar is not None and (not self.grammar.ready
                                             or self.grammar.error is not None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens already handed to a step, finished or not: where the next step starts."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens the model still has to be fed, counting those being sampled right now."""
        return self.num_tokens + self.num_output_placeholders - self.num_scheduled_tokens

    @property
    def max_num_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]
