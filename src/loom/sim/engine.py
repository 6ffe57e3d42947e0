"""The real scheduler and KV cache manager, with a step-time model in place of the model runner,
on a virtual clock.

The scheduler sees only token counts and block ids, so nothing in it knows the difference:
each step is scheduled by `core/` exactly as the engine would, its duration comes from the
profile, and every sampled token is a stand-in id. Requests end by length (the trace's output
length, asked with ignore_eos), because an end by EOS cannot be known without the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import SchedulerConfig
from loom.core.batch import ModelRunnerOutput, SchedulerOutput
from loom.core.kv_cache import KVCacheManager
from loom.core.scheduler import RequestUpdate, Scheduler
from loom.core.static import StaticScheduler
from loom.plan.roofline import StepModel, StepWork

STAND_IN_TOKEN = 0  # what every simulated step "samples"; never a stop token (ignore_eos)


@dataclass
class SimStep:
    """One simulated step: what was scheduled, what it did, when it ended."""

    output: SchedulerOutput
    updates: list[RequestUpdate]
    start: float
    end: float


class SimEngine:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool, max_model_len: int, step_model: StepModel) -> None:
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        scheduler_cls = StaticScheduler if config.scheduler == "static" else Scheduler
        self.scheduler: Scheduler = scheduler_cls(config, self.kv_cache, max_model_len)
        self.step_model = step_model
        self.now = 0.0
        self.num_steps = 0
        self.busy_s = 0.0

    def step(self) -> SimStep | None:
        """Schedule and "run" one step, advancing the clock by its modelled duration; None
        when nothing can be scheduled now."""
        output = self.scheduler.schedule()
        if output.is_empty:
            return None
        duration = self.step_model.time(StepWork.of(
            (len(s.token_ids), s.start_position, s.sample) for s in output.scheduled))
        start, self.now = self.now, self.now + duration
        self.busy_s += duration
        self.num_steps += 1
        sampled = {s.request_id: STAND_IN_TOKEN for s in output.scheduled
                   if s.sample and not s.padding}
        updates = self.scheduler.update(output, ModelRunnerOutput(sampled_token_ids=sampled))
        return SimStep(output, updates, start, self.now)
