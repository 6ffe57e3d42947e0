"""The fixed-batch baseline: same model, cache and step loop, but a batch is formed only when
the previous one has completely finished. It exists so the benefit of continuous batching is
measured, not assumed."""

from __future__ import annotations

from collections.abc import Iterator

from loom.core.batch import SchedulerOutput
from loom.core.scheduler import Scheduler
from loom.request import Request


class StaticScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch_ids: set[str] = set()

    def schedule(self) -> SchedulerOutput:
        self.batch_ids &= self.requests.keys()
        if not self.batch_ids:
            head = self.waiting[: self.config.max_num_seqs]
            self.batch_ids = {request.request_id for _, request in head}
        return super().schedule()

    def _admission_candidates(self) -> Iterator[Request]:
        for request in super()._admission_candidates():
            if request.request_id in self.batch_ids:
                yield request
