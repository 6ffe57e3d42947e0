"""Continuous batching: the batch is re-formed at every model iteration.

Each step fills a token budget: running requests first (one decode token each, or the next
chunk of a prefill in progress), then waiting requests in policy order while the budget, the
sequence limit and the KV cache allow. When the cache cannot hold a running request's next
tokens, the lowest-priority / latest-arrived running request is preempted: its blocks are freed
and it goes back to the waiting queue to be recomputed later.

The scheduler may run one step ahead of the model (async scheduling): a request that samples in
the step now running is scheduled again with a placeholder for the token being sampled, unless
that token is certain to be its last.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from loom.config import SchedulerConfig
from loom.core.batch import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from loom.core.kv_cache import KVCacheManager
from loom.core.spec_decode import NgramProposer
from loom.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class RequestUpdate:
    """What one step did to one request: the tokens it added (one sampled token, after any
    accepted draft tokens) and whether it ended."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: list[tuple[tuple[int, int], Request]] = []  # sorted by policy key
        self.running: list[Request] = []
        self.finished_request_ids: list[str] = []
        self.num_preemptions = 0
        self._num_arrivals = 0
        spec = config.speculative
        self.proposer = NgramProposer(spec) if spec is not None else None

    # -- queue bookkeeping ---------------------------------------------------------------------

    def _key(self, request: Request) -> tuple[int, int]:
        """Admission order; the largest key is the first preemption victim."""
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return (priority, request.arrival_order)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, (self._key(request), request), key=lambda e: e[0])

    def _dequeue(self, request: Request) -> None:
        index = bisect.bisect_left(self.waiting, self._key(request), key=lambda e: e[0])
        del self.waiting[index]

    def _admission_candidates(self) -> Iterator[Request]:
        for _, request in list(self.waiting):
            yield request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; it may join the very next step. Raises ValueError if it can never
        run (too long for the model or for the whole KV cache)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; this model's "
                             f"max_model_len is {self.max_model_len} (prompt + at least one "
                             "output token must fit)")
        needed_tokens = min(request.max_num_tokens, self.max_model_len)
        needed_blocks = self.kv_cache.num_blocks_for(needed_tokens)
        if needed_blocks > self.kv_cache.pool.num_blocks:
            raise ValueError(f"request needs up to {needed_tokens} tokens of KV cache "
                             f"({needed_blocks} blocks) but the whole cache holds "
                             f"{self.kv_cache.pool.num_blocks} blocks; shorten it or enlarge "
                             "kv_cache_memory / num_kv_blocks")
        if (not self.config.enable_chunked_prefill
                and request.num_prompt_tokens > self.config.max_num_batched_tokens):
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens, more than "
                             f"max_num_batched_tokens={self.config.max_num_batched_tokens} "
                             "with chunked prefill disabled")
        request.arrival_order = self._num_arrivals  # unique: ties in the queue key are impossible
        self._num_arrivals += 1
        self.requests[request.request_id] = request
        self._enqueue(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def stop_on_string(self, request: Request, stop: str, num_surplus_tokens: int) -> None:
        """End a request at a stop string, the one end only the detokenized text shows: its
        last `num_surplus_tokens` tokens (accepted drafts past the string) are dropped. If the
        same step already ended it past the string (length, EOS), the string is the reason;
        a request already ended by the token that completed the string keeps that reason."""
        if num_surplus_tokens:
            del request.output_token_ids[-num_surplus_tokens:]
        if request.request_id in self.requests:
            self._finish(request, RequestStatus.FINISHED_STOPPED, stop)
        elif num_surplus_tokens:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop

    def fail_request(self, request_id: str) -> None:
        """End a request whose step failed. Its blocks that step was computing are withdrawn
        from the prefix cache, and running requests that already found them go back to the
        queue to be recomputed."""
        request = self.requests.get(request_id)
        if request is None:
            return
        withdrawn = set(self.kv_cache.withdraw_uncomputed_blocks(request))
        self._finish(request, RequestStatus.FINISHED_ERROR)
        for other in list(self.running):
            if withdrawn.intersection(self.kv_cache.get_block_table(other.request_id)):
                self._requeue(other)

    def _finish(self, request: Request, status: RequestStatus,
                stop_reason: str | int | None = None) -> None:
        """The one place a request ends: off the queues, blocks released, status and the
        reason recorded for the output."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._dequeue(request)
        self._release(request)
        request.status, request.stop_reason = status, stop_reason
        del self.requests[request.request_id]
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        self.finished_request_ids.append(request.request_id)

    def _release(self, request: Request) -> None:
        self.kv_cache.free(request)

    def _num_padding_slots(self) -> int:
        """Sequence slots (one token each) taken this step by something other than a live
        request; only the fixed-batch baseline has any."""
        return 0

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens - self._num_padding_slots()
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []

        if self.proposer is not None:
            self.proposer.new_step()
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_pending_tokens, budget)
            if num_new <= 0 or self._last_token_in_flight(request) or (
                    request.grammar is not None and request.num_output_placeholders):
                continue  # a constrained request's next mask needs the token being sampled
            drafts = self._drafts(request, budget - 1) if num_new == 1 else []
            if drafts and self.kv_cache.allocate_slots(request, 1 + len(drafts)):
                scheduled[request.request_id] = self._scheduled(request, 1, drafts)
                budget -= 1 + len(drafts)
                continue
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = max(self.running, key=self._key)
                if victim.request_id in scheduled:
                    budget += len(scheduled.pop(victim.request_id).token_ids)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = self._scheduled(request, num_new)
                budget -= num_new

        for request in self.running:  # no preemption can drop their work from here on
            if request.request_id in scheduled:
                self._publish_scheduled_blocks(request)
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)

        output = SchedulerOutput(scheduled=list(scheduled.values()),
                                 preempted_request_ids=preempted,
                                 finished_request_ids=self.finished_request_ids)
        if scheduled:  # an empty step is not run, so its news waits for the next one
            self.finished_request_ids = []
        return output

    def _last_token_in_flight(self, request: Request) -> bool:
        """Whether a step already running samples this request's final token (length limit)."""
        if not request.num_output_placeholders:
            return False
        num_outputs = len(request.output_token_ids) + request.num_output_placeholders
        return (num_outputs >= request.sampling_params.max_tokens
                or request.num_tokens + request.num_output_placeholders >= self.max_model_len)

    def _drafts(self, request: Request, room: int) -> list[int]:
        """Draft tokens for a decoding request (speculative decoding), within the step's
        remaining budget and the request's own limits; none where they could not be used."""
        params = request.sampling_params
        if (self.proposer is None or request.num_output_placeholders
                or params.logprobs is not None or params.penalized
                or len(request.output_token_ids) < params.min_tokens):
            return []  # penalties and bans change with every token: verify_drafts has neither
        room = min(room, params.max_tokens - len(request.output_token_ids) - 1,
                   self.max_model_len - request.num_tokens - 1)
        drafts = self.proposer.propose(request, room) if room > 0 else []
        if drafts and request.grammar is not None:  # only drafts the grammar would allow
            drafts = drafts[:request.grammar.num_allowed(drafts)]
        return drafts

    def _admit_waiting(self, budget: int, scheduled: dict[str, ScheduledRequest]) -> int:
        for request in self._admission_candidates():
            if (budget <= 0 or len(self.running) + self._num_padding_slots()
                    >= self.config.max_num_seqs):
                break
            if request.waiting_for_grammar:
                continue
            cached_blocks = self.kv_cache.find_cached_prefix(request)
            num_cached = len(cached_blocks) * self.kv_cache.block_size
            num_new = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            # A chunk that ends the known tokens samples one: room for its KV too. Without it a
            # request re-admitted with its tokens ending a block took the last free blocks,
            # needed one more the next step and, the latest arrival, was its own victim (11
            # preemptions where 3 do, with async scheduling).
            samples = num_new == request.num_tokens - num_cached
            if not self.kv_cache.allocate_slots(request, num_new + samples, cached_blocks):
                break
            self._dequeue(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            self.running.append(request)
            scheduled[request.request_id] = self._scheduled(request, num_new)
            self._publish_scheduled_blocks(request)
            budget -= num_new
        return budget

    def _publish_scheduled_blocks(self, request: Request) -> None:
        """Offer the blocks this step fills to the prefix cache now, not after the step ran:
        a request admitted later in this same step (the next RAG question on a shared
        document) then skips recomputing them. Blocks holding a token not yet sampled wait."""
        self.kv_cache.cache_blocks(request, min(request.num_scheduled_tokens, request.num_tokens))

    def _scheduled(self, request: Request, num_new: int, drafts: list[int] | None = None
                   ) -> ScheduledRequest:
        """Hand `num_new` of the request's tokens to this step, and after them any draft
        tokens (fed to the model for it to verify, in the same step)."""
        drafts = drafts or []
        start, end = request.num_scheduled_tokens, request.num_scheduled_tokens + num_new
        known_end = min(end, request.num_tokens)
        token_ids = request.token_ids_slice(start, known_end)
        token_ids += [PLACEHOLDER_TOKEN_ID] * (end - known_end)
        sample = end == request.num_tokens + request.num_output_placeholders
        request.num_inflight_tokens += num_new + len(drafts)
        request.num_output_placeholders += sample
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids + drafts,
            num_draft_tokens=len(drafts),
            start_position=start,
            block_ids=list(self.kv_cache.get_block_table(request.request_id)),
            sliding_block_ids=list(self.kv_cache.get_sliding_block_table(request.request_id)),
            sampling_params=request.sampling_params,
            sample=sample,
            prompt_token_ids=request.prompt_token_ids,
            banned_token_ids=self._banned(request) if sample else (),
        )

    @staticmethod
    def _banned(request: Request) -> tuple[int, ...]:
        """EOS and the stop tokens while the token about to be sampled could not end the
        request (`_token_stop`: before min_tokens), as vLLM's min-tokens processor does."""
        params = request.sampling_params
        count = len(request.output_token_ids) + request.num_output_placeholders  # this one's
        if count >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else tuple(request.eos_token_ids)
        return (*eos, *params.stop_token_ids)

    def _preempt(self, request: Request) -> None:
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        logger.warning(
            "Request %s is preempted by PreemptionMode.RECOMPUTE mode because there is not "
            "enough KV cache space. This can affect the end-to-end performance. Increase "
            "kv_cache_memory or num_kv_blocks, or decrease max_num_seqs or "
            "max_num_batched_tokens. total_num_preemptions=%d",
            request.request_id, self.num_preemptions)

    def _requeue(self, request: Request) -> None:
        """Free a running request's blocks and queue it to be recomputed from scratch."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_inflight_tokens = 0  # a step still running for it is ignored on return
        request.num_output_placeholders = 0
        self._enqueue(request)

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput
               ) -> list[RequestUpdate]:
        """Advance every scheduled request by what the model computed; end those that stop."""
        updates = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # ended or preempted while the step ran
            accepted = self._accepted_drafts(item, runner_output)
            # Rejected drafts' KV lies past num_computed_tokens: the next step overwrites it.
            request.num_computed_tokens += len(item.token_ids) - item.num_draft_tokens + \
                len(accepted)
            request.num_inflight_tokens -= len(item.token_ids)
            self.kv_cache.cache_blocks(request, request.num_computed_tokens)
            self.kv_cache.slide(request, request.num_computed_tokens)
            if not item.sample:
                continue
            request.num_output_placeholders -= 1
            new_token_ids, stop = [], None
            for token_id in [*accepted, runner_output.sampled_token_ids[item.request_id]]:
                request.output_token_ids.append(token_id)
                new_token_ids.append(token_id)
                stop = self._token_stop(request, token_id)
                if stop is not None:
                    self._finish(request, *stop)
                    break
            updates.append(RequestUpdate(request, new_token_ids, stop is not None))
        return updates

    def _accepted_drafts(self, item: ScheduledRequest, runner_output: ModelRunnerOutput
                         ) -> list[int]:
        if not item.num_draft_tokens:
            return []
        accepted = runner_output.accepted_draft_ids.get(item.request_id, [])
        self.proposer.record(item.request_id, item.num_draft_tokens, len(accepted))
        return accepted

    def _token_stop(self, request: Request, token_id: int
                    ) -> tuple[RequestStatus, int | None] | None:
        """(status, stop reason) if this token ends the request: a stop token (its id is the
        reason), EOS (no reason, as OpenAI and vLLM report it), a grammar completed (as EOS)
        or the length limit. A constrained request's matcher advances here, by final tokens
        only."""
        grammar = request.grammar
        if grammar is not None:
            if not grammar.accept(token_id):
                return RequestStatus.FINISHED_ERROR, None
            if grammar.terminated:
                return RequestStatus.FINISHED_STOPPED, None
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, None
        if num_output >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None
