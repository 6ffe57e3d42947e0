"""`loom simulate calibrate --served`: add to an offline profile what `loom serve` costs on top
of the engine on the same cores (the event loop, the SSE stream, the engine-process pipe).

`loom simulate calibrate` times `EngineCore.step()` alone; a served request also waits on the
HTTP front end, so the offline profile is optimistic. This replays one calibration trace as a
closed loop of N users against a real `loom serve` on loopback (`loom bench`'s replay) and
simulates the same loads on the offline profile. The gap in mean TPOT at two or more loads is
fitted as extra seconds per step plus seconds per running sequence (streaming one more token
per step is per-sequence work), least squares, each term >= 0: the served engine's overheads.
The profile keeps its offline fit and records the points and the terms it added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loom.config import CacheConfig, SchedulerConfig
from loom.sim.profile import Profile
from loom.sim.result import SimConfig, simulate_run
from loom.workload.load import Load
from loom.workload.results import RunResult
from loom.workload.trace import Trace

# runs a real `loom serve` with these flags and replays the trace at the load against it (the
# command line's: loom.sim stays below the HTTP client)
Serve = Callable[[list[str], Trace, Load, Path], RunResult]


@dataclass(frozen=True)
class ServedPoint:
    """One closed-loop load, measured on `loom serve` and simulated on the profile."""

    users: int
    served_tpot_s: float
    simulated_tpot_s: float
    served_ttft_s: float
    simulated_ttft_s: float


def sim_config(profile: Profile, max_model_len: int) -> SimConfig:
    """The simulated server the calibration replays: the profile's cache, default scheduler."""
    return SimConfig("loom", profile, SchedulerConfig(),
                     CacheConfig(num_kv_blocks=profile.num_kv_blocks), max_model_len=max_model_len)


def fit_overheads(profile: Profile, points: list[ServedPoint]) -> Profile:
    """The offline profile plus a per-step and a per-sequence term fitted to the TPOT gaps
    (gap = step + seq * users, least squares over the points, each term clamped at 0)."""
    if len({p.users for p in points}) < 2:
        raise ValueError("served calibration needs closed-loop points at two or more loads")
    xs = [float(p.users) for p in points]
    ys = [p.served_tpot_s - p.simulated_tpot_s for p in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    seq_s = max(0.0, slope)
    step_s = max(0.0, sum(y - seq_s * x for x, y in zip(xs, ys)) / n)
    m = profile.step_model
    model = dataclasses.replace(m, step_s=m.step_s + step_s, seq_s=m.seq_s + seq_s)
    meta = {**profile.meta, "served": {
        "added_step_s": step_s, "added_seq_s": seq_s,
        "points": [dataclasses.asdict(p) for p in points],
        "note": "TPOT gap of loom serve over the offline profile, closed loops on loopback"}}
    return dataclasses.replace(profile, step_model=model, meta=meta)


def measure_points(profile: Profile, trace: Trace, ids: list[list[int]], users: tuple[int, ...],
                   max_model_len: int, work_dir: Path, serve: Serve) -> list[ServedPoint]:
    """Each closed loop served (a fresh `loom serve` with the profile's cache) and simulated."""
    config = sim_config(profile, max_model_len)
    points = []
    for n in users:
        load = Load(max_concurrency=n)
        real = serve(config.flags(), trace, load, work_dir / f"served-{n}.log")
        sim = simulate_run(config, trace, ids, load)
        points.append(ServedPoint(n, real.get("mean_tpot_ms") / 1e3,
                                  sim.get("mean_tpot_ms") / 1e3,
                                  real.get("median_ttft_ms") / 1e3,
                                  sim.get("median_ttft_ms") / 1e3))
    return points
