"""`loom simulate calibrate --served`: add to an offline profile what `loom serve` costs on top
of the engine on the same cores (the event loop, the SSE stream, the engine-process pipe).

`loom simulate calibrate` times `EngineCore.step()` alone; a served request also passes the
HTTP front end and the pipe. This replays one calibration trace as closed loops of N users
against a real `loom serve` on loopback (`loom bench`'s replay) and fits extra seconds per
step, per scheduled sequence and per token fed (TERMS) so that simulating the same loops
reproduces the served mean TPOT and median TTFT at every load (`fit_overheads`).

What the terms stand for was measured with timestamps in the served engine process (2-core
EPYC, 2026-12-07): the server and the client used under 5% of a core between them, the pipe
0.2-0.4 ms a step, the gap between steps 0.3-0.5 ms; the served steps themselves were what
ran long. Most of that was the sampler: a served request that sets no sampling gets the
model's defaults (top_p 0.9 for the bundled model, then a sort of the whole vocabulary a
sequence), which the offline calibration now times too. The rest is left to these terms; the
profile keeps its offline fit and records the points, the terms and what the fitted profile
simulates at each point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


# The server's terms, added to the offline StepModel's: per step, per scheduled sequence, per
# token fed (a prefill chunk's tokens; a decode step feeds one a sequence, so in decode the
# last two add up). Finite-difference sizes for the fit's sensitivities.
TERMS = {"step_s": 1e-3, "seq_s": 1e-3, "token_s": 1e-4}
_ITERATIONS = 4  # Gauss-Newton steps: the figures are close to linear in the terms


def with_overheads(profile: Profile, added: dict[str, float]) -> Profile:
    """The profile with `added` seconds on its step model's terms (names from TERMS)."""
    m = profile.step_model
    return dataclasses.replace(profile, step_model=dataclasses.replace(
        m, **{k: getattr(m, k) + v for k, v in added.items()}))


def simulated_figures(profile: Profile, trace: Trace, ids: list[list[int]],
                      users: list[int], max_model_len: int) -> list[float]:
    """Mean TPOT and median TTFT (s) of each closed loop, simulated on `profile`."""
    config = sim_config(profile, max_model_len)
    out = []
    for n in users:
        run = simulate_run(config, trace, ids, Load(max_concurrency=n))
        out += [run.get("mean_tpot_ms") / 1e3, run.get("median_ttft_ms") / 1e3]
    return out


def fit_overheads(profile: Profile, points: list[ServedPoint], trace: Trace,
                  ids: list[list[int]], max_model_len: int) -> Profile:
    """The offline profile plus the TERMS that make its simulation reproduce the served mean
    TPOT and median TTFT of every closed loop: least squares in relative error, each term
    >= 0 (one that would go negative is dropped), through the real scheduler, so each load's
    batch sizes and prefill chunks are what its steps really held (a closed loop of N users
    runs fewer than N sequences for much of its time). TPOT weighs the per-step and decode
    terms; TTFT the prefill chunks' tokens."""
    if len({p.users for p in points}) < 2:
        raise ValueError("served calibration needs closed-loop points at two or more loads")
    users = [p.users for p in points]
    target = np.array([x for p in points for x in (p.served_tpot_s, p.served_ttft_s)])
    names, steps = list(TERMS), np.array(list(TERMS.values()))
    added = np.zeros(len(names))

    def figures(terms: np.ndarray) -> np.ndarray:
        return np.array(simulated_figures(with_overheads(profile, dict(zip(names, terms))),
                                          trace, ids, users, max_model_len))

    for _ in range(_ITERATIONS):
        base = figures(added)
        jacobian = np.column_stack([(figures(added + np.eye(len(names))[j] * steps[j]) - base)
                                    / steps[j] for j in range(len(names))])
        # linearised: base + J (new - added) = target, in relative error
        a = jacobian * steps / target[:, None]
        b = (target - base + jacobian @ added) / target
        keep = list(range(len(names)))
        while True:
            coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                break
            del keep[int(np.argmin(coef))]
        added = np.zeros(len(names))
        added[keep] = np.clip(coef, 0, None) * steps[keep]
    terms = {name: float(v) for name, v in zip(names, added)}
    served = with_overheads(profile, terms)
    fitted = simulated_figures(served, trace, ids, users, max_model_len)
    meta = {**profile.meta, "served": {
        **{f"added_{k}": v for k, v in terms.items()},
        "points": [dataclasses.asdict(p) for p in points],
        "fitted_tpot_ttft_s": dict(zip(map(str, users), zip(fitted[::2], fitted[1::2]))),
        "note": "loom serve's mean TPOT and median TTFT over the offline profile's, closed "
                "loops on loopback, fitted through the simulator"}}
    return dataclasses.replace(served, meta=meta)


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
