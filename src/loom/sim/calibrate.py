"""`loom simulate calibrate`: time loom's own engine offline on this machine over a grid of
prefill tokens x decode sequences x context length, and fit the roofline-shaped StepModel
(per-step constant, which here includes reading the weights once; per sequence; per token;
per KV byte read; per FLOP) to the measured steps, in relative error. One grid point in four
is held back from the fit and the fit's error on those is reported.

The engine runs through its public surface: `EngineCore(config)`, its `add_request` and
`step()` (synchronous, as `LLM` drives it). Each measured step is the scheduler's own output,
read as it leaves `schedule()`, so the fit sees exactly the work that was timed. Requests
sample with the engine's defaults (what a served request that sets none gets), since the
sampler's cost is per sequence and varies with them (greedy is cheaper than top-p).
"""

from __future__ import annotations

import datetime
import logging
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from loom import host
from loom.config import EngineConfig
from loom.plan.roofline import ModelShape, StepModel, StepWork
from loom.sim.profile import Profile

logger = logging.getLogger(__name__)

# (prefill tokens, decode sequences, context tokens). "default" runs in a few minutes on an
# idle 2-core machine with the bundled model; "quick" is a smoke test.
GRIDS = {
    "quick": ((0, 64), (0, 1, 4), (64, 256)),
    "default": ((0, 32, 128, 512), (0, 1, 4, 16, 32), (128, 768)),
}


@dataclass
class Sample:
    work: StepWork
    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


class _Bench:
    """An engine with a spy on its scheduler: what each step scheduled, and how long it took."""

    def __init__(self, config: EngineConfig) -> None:
        from loom.engine.core import EngineCore

        self.engine = EngineCore(config)
        self.vocab = self.engine.tokenizer.vocab_size
        self.rng = random.Random(0)
        self._ids = 0
        self.last = None
        schedule = self.engine.scheduler.schedule

        def spy() -> Any:
            self.last = schedule()
            return self.last

        self.engine.scheduler.schedule = spy

    def add(self, num_tokens: int, max_tokens: int) -> str:
        self._ids += 1
        request_id = f"calibrate-{self._ids}"
        prompt = [self.rng.randrange(100, self.vocab - 100) for _ in range(num_tokens)]
        # sampled as a served request that sets no sampling is, with the model's defaults:
        # sampling costs per sequence, and top-k / top-p more than greedy
        self.engine.add_request(request_id, prompt, self.engine.sampling_defaults.params(
            max_tokens=max_tokens, ignore_eos=True))
        return request_id

    def step(self) -> tuple[StepWork, float]:
        start = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - start
        items = self.last.scheduled
        return StepWork.of((len(s.token_ids), s.start_position, s.sample) for s in items), seconds


def measure(bench: _Bench, grid: tuple[tuple[int, ...], ...], repeats: int) -> list[Sample]:
    prefills, decodes, contexts = grid
    max_len = bench.engine.max_model_len
    bench.add(max(prefills), 2)  # warm-up: first-use costs (allocations, kernels) stay out
    bench.step()
    bench.step()
    samples = []
    for decode in decodes:
        for context in (contexts if decode else contexts[:1]):
            running = [bench.add(context, max_len - context - 1) for _ in range(decode)]
            for _ in range(10_000):  # prefill them (the bound only guards against a bug)
                if not decode or _all_decoding(bench, decode):
                    break
            for prefill in prefills:
                if not decode and not prefill:
                    continue
                times, work = [], None
                for _ in range(repeats):
                    if prefill:
                        bench.add(prefill, 1)  # prefilled and finished in the timed step
                    work, seconds = bench.step()
                    times.append(seconds)
                samples.append(Sample(work, times))
                logger.info("prefill %d, decode %d x ctx %d: %.1f ms", prefill, decode,
                            context, 1e3 * statistics.median(times))
            for request_id in running:
                bench.engine.abort_request(request_id)
    return samples


def _all_decoding(bench: _Bench, decode: int) -> bool:
    work, _ = bench.step()
    return work.seqs == decode and work.tokens == decode


def fit(samples: list[Sample], shape: ModelShape) -> StepModel:
    """Non-negative least squares in relative error over [1, seqs, tokens, KV bytes, FLOPs]:
    a negative coefficient is dropped and the rest refitted until none is left."""
    probe = StepModel(shape, 0, 0, 0, 0, 0, "sum")
    columns = np.array([[1.0, s.work.seqs, s.work.tokens, probe.memory_bytes(s.work),
                         probe.flops(s.work)] for s in samples])
    target = np.array([s.median_s for s in samples])
    scale = columns.max(axis=0)
    scale[scale == 0] = 1.0
    a = columns / scale / target[:, None]
    keep = list(range(columns.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], np.ones(len(target)), rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        del keep[int(np.argmin(coef))]
    full = np.zeros(columns.shape[1])
    full[keep] = np.clip(coef, 0, None)
    full /= scale
    return StepModel(shape, step_s=full[0], seq_s=full[1], token_s=full[2], byte_s=full[3],
                     flop_s=full[4], combine="sum")


def errors(model: StepModel, samples: list[Sample]) -> dict[str, float]:
    rel = [abs(model.time(s.work) / s.median_s - 1) for s in samples]
    return {"points": len(rel), "mean_abs_pct": 100 * float(np.mean(rel)),
            "max_abs_pct": 100 * float(np.max(rel))}


def calibrate(config: EngineConfig, grid_name: str, repeats: int) -> Profile:
    from loom.model.arch import default_model_path
    from loom.model.model_files import read_arch

    config = replace(config, scheduler=replace(config.scheduler, async_scheduling=False))
    bench = _Bench(config)
    arch = read_arch(config.model.model or default_model_path())
    shape = ModelShape.of(arch, 1, bench.engine.runner.backends.kv_dtype.itemsize, 0)
    wall = time.perf_counter()
    samples = measure(bench, GRIDS[grid_name], repeats)
    wall = time.perf_counter() - wall
    num_threads = bench.engine.runner.backends.num_threads
    held_out = samples[3::4]
    train = [s for i, s in enumerate(samples) if i % 4 != 3]
    model = fit(train, shape)
    return Profile(
        source="calibrated", step_model=model,
        model=str(config.model.model or default_model_path().name),
        max_model_len=bench.engine.max_model_len, num_kv_blocks=bench.engine.num_kv_blocks,
        block_size=bench.engine.block_size,
        meta={"gpu": {"key": "this", "name": host.describe()}, "host": host.describe(),
              "date": datetime.date.today().isoformat(), "grid": grid_name,
              "repeats": repeats, "measure_wall_s": wall, "num_threads": num_threads,
              "fit_error_train": errors(model, train), "fit_error_held_out": errors(model,
                                                                                   held_out),
              "samples": [{"work": vars(s.work), "seconds": s.seconds} for s in samples],
              "engine_config": {k: vars(getattr(config, k)) for k in config.SECTIONS},
              "sampling": {**bench.engine.sampling_defaults.overridden(),
                           "source": bench.engine.sampling_defaults.source},
              "note": "weights are read once per step, so their cost is in step_s"})
