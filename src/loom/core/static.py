"""The fixed-batch baseline: same model, cache and step loop, but a batch is formed only when
the previous one has completely finished. It exists so the benefit of continuous batching is
measured, not assumed.

As in fixed batching everywhere (padded `generate` calls), a member that finishes early keeps
its place in the batch until the longest member is done: its answer is delivered at once, but
each step still computes a padding token for it (reading its old context, writing nowhere that
matters), so the step costs what a fixed batch costs. Its KV blocks are freed at once, which
only flatters the baseline.
"""

from __future__ import annotations

from collections.abc import Iterator

from loom.core.batch import ScheduledRequest, SchedulerOutput
from loom.core.scheduler import Scheduler
from loom.request import Request, RequestStatus


class StaticScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch_ids: set[str] = set()
        self.padding: list[ScheduledRequest] = []
        self._pad_this_step = False

    def schedule(self) -> SchedulerOutput:
        self.batch_ids &= self.requests.keys()
        if not self.batch_ids:
            self.padding = []
            head = self.waiting[: self.config.max_num_seqs]
            self.batch_ids = {request.request_id for _, request in head}
        # Padding runs alongside decodes only: while a member still waits for its prefill
        # (not yet admitted, or preempted), its slot must not be taken by padding.
        self._pad_this_step = all(self.requests[i].status == RequestStatus.RUNNING
                                  for i in self.batch_ids)
        output = super().schedule()
        if self._pad_this_step:
            output.scheduled += self.padding
        return output

    def _admission_candidates(self) -> Iterator[Request]:
        for request in super()._admission_candidates():
            if request.request_id in self.batch_ids:
                yield request

    def _num_padding_slots(self) -> int:
        return len(self.padding) if self._pad_this_step else 0

    def _release(self, request: Request) -> None:
        others_left = self.batch_ids & self.requests.keys() - {request.request_id}
        if request.status == RequestStatus.RUNNING and others_left:
            # its last fed token (a step may still be running: the fed count is ahead)
            position = min(request.num_scheduled_tokens, request.num_tokens) - 1
            self.padding.append(ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.token_ids_slice(position, position + 1),
                start_position=position,
                block_ids=list(self.kv_cache.get_block_table(request.request_id)),
                sliding_block_ids=list(
                    self.kv_cache.get_sliding_block_table(request.request_id)),
                sampling_params=request.sampling_params, sample=False,
                prompt_token_ids=request.prompt_token_ids, padding=True))
        super()._release(request)
