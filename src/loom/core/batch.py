"""The plain data that crosses between scheduler and model runner, one step at a time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loom.outputs import TokenLogprob
from loom.sampling import SamplingParams

# Stands for a token that an in-flight step is sampling; the engine fills it in when that step
# ends (async scheduling). The runner refuses to embed it.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class SlidingKVGroup:
    """The sliding-window layers' KV blocks, kept apart from the full layers' (which the
    scheduler admits against): `num_blocks` blocks of their own, of which a request holds only
    those its window still reaches (core/kv_cache.py frees the rest as it advances). The runner
    allocates them (`initialize_kv_cache` returns this) and the KV cache manager hands them out.
    Block id `null_block`, one past the pool, stands for a block that slid out of the window:
    the runner's scratch block of the group, never read."""

    window: int  # positions a query attends to, its own included (W)
    num_blocks: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.num_blocks < 1:
            raise ValueError(f"a sliding KV group needs window >= 1 and num_blocks >= 1, got "
                             f"{self.window} and {self.num_blocks}")

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @staticmethod
    def blocks_needed(window: int, block_size: int, max_num_seqs: int,
                      max_num_batched_tokens: int) -> int:
        """Blocks that always suffice (the picture in KVCacheManager.allocate_slots says why):
        a running request holds the blocks its window reaches back to from its next token,
        ceil((W - 1) / block_size) + 1, plus those of its tokens scheduled and not yet
        computed: over one step's requests at most ceil(max_num_batched_tokens / block_size)
        and one partial block each, and one more each for the token a prompt's last chunk
        samples or for rejected draft tokens. Twice the step's tokens: with async scheduling a
        request whose step is in flight, and not in the next one, still holds its blocks."""
        window_blocks = -(-(window - 1) // block_size) + 1
        step_blocks = -(-max_num_batched_tokens // block_size)
        return max_num_seqs * (window_blocks + 2) + 2 * step_blocks


@dataclass
class ScheduledRequest:
    """One request's share of a step: feed `token_ids` at positions starting at
    `start_position`, reading and writing KV through `block_ids` (and, for sliding-window
    layers in a KV group of their own, through `sliding_block_ids`)."""

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
    # Speculative decoding: the last `num_draft_tokens` of token_ids are guesses; the runner
    # samples at each of them and keeps the run the model agrees with.
    num_draft_tokens: int = 0
    # Tokens the sample may not be: EOS and stop tokens while fewer than min_tokens have been
    # generated (they could not end the request, so sampling one would only derail it).
    banned_token_ids: tuple[int, ...] = ()
    # The sliding layers' block table (SlidingKVGroup), as long as block_ids; the blocks
    # before the window of this step's first token are the group's null block. Empty without
    # such a group.
    sliding_block_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class GrammarBitmask:
    """The tokens each constrained request may sample this step (structured outputs): row i
    of `bitmask` (int32 [n, ceil(vocab / 32)], bit j of word w allowing token 32 w + j) is
    request_ids[i]'s. A request with k draft tokens has k + 1 rows in a row, one per position
    its drafts are verified at (the grammar's state after each draft); requests without a
    constraint have none."""

    request_ids: list[str]
    bitmask: Any  # a numpy array: plain data, no torch on the scheduler's side

    def first_rows(self) -> dict[str, int]:
        """Each constrained request's first row."""
        first: dict[str, int] = {}
        for row, request_id in enumerate(self.request_ids):
            first.setdefault(request_id, row)
        return first


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous non-empty step: the runner drops their
    # per-request state when it runs this one.
    finished_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def fill_placeholders(self, previous: ModelRunnerOutput) -> None:
        """Put the tokens the previous step sampled where this step has placeholders for them
        (async scheduling). A request the previous step has no token for (its step failed)
        has ended, and is dropped from this one."""
        kept = []
        for item in self.scheduled:
            if item.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                token_id = previous.sampled_token_ids.get(item.request_id)
                if token_id is None:
                    continue
                item.token_ids[-1] = token_id
            kept.append(item)
        self.scheduled = kept


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # request id -> the draft tokens the model agreed with, in order; they precede the
    # request's sampled token (speculative decoding)
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request id -> (first prompt position covered, logprobs of those prompt tokens)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
