"""`loom simulate calibrate --served PROFILE --output OUT`: add the served engine's measured
overheads to an offline profile (loom.sim.served), on a calibration trace of its own."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from loom.cli.flags import check_writable

if TYPE_CHECKING:
    from loom.workload.load import Load
    from loom.workload.results import RunResult
    from loom.workload.trace import Trace

USERS = (1, 16)  # the closed loops measured: one user, and the load the check runs at
MIX = "chat=0.6,long=0.15,rag=0.25"
NUM_REQUESTS, SEED = 24, 7  # the calibration trace (a check runs on another seed's)


def calibration_trace(num_requests: int, seed: int) -> tuple[Trace, list[list[int]]]:
    """The bundled tokenizer's mixed trace (the same generator `loom bench trace` uses)."""
    from loom.sim.replay import prompt_token_ids
    from loom.workload.mix import ArrivalSpec, CancelSpec, generate_mix, parse_mix
    from loom.workload.tokens import PromptSynth, load_tokenizer, tokenizer_path

    path = tokenizer_path(None)
    trace = generate_mix(parse_mix(MIX), num_requests, seed, PromptSynth(load_tokenizer(path)),
                         ArrivalSpec(), CancelSpec(), path.name)
    return trace, prompt_token_ids(trace, load_tokenizer(path), seed)


def serve_and_replay(flags: list[str], trace: Trace, load: Load, log: Path) -> RunResult:
    """A fresh `loom serve` with `flags` on loopback, the trace replayed at `load` by `loom
    bench`'s client."""
    import asyncio
    import shlex

    from loom.bench.replay import Target, replay
    from loom.bench.server import LOOM_SERVE, LocalServer

    with LocalServer(LOOM_SERVE, shlex.join(flags), log) as server:
        return asyncio.run(replay(trace, load, Target(server.url, server_pid=server.pid),
                                  progress=False))


def calibrate_served(offline: str, output: str, num_requests: int = NUM_REQUESTS,
                     seed: int = SEED) -> int:
    from loom.sim.profile import Profile
    from loom.sim.served import fit_overheads, measure_points

    check_writable(output, "--output")
    profile = Profile.load(offline)
    trace, ids = calibration_trace(num_requests, seed)
    work = Path(output).with_suffix(".served-logs")
    work.mkdir(parents=True, exist_ok=True)
    points = measure_points(profile, trace, ids, USERS, profile.max_model_len, work,
                            serve_and_replay)
    served = fit_overheads(profile, points, trace, ids, profile.max_model_len)
    served.save(output)
    for p in points:
        print(f"{p.users} users: TPOT served {p.served_tpot_s * 1e3:.1f} ms, simulated "
              f"{p.simulated_tpot_s * 1e3:.1f} ms; median TTFT served "
              f"{p.served_ttft_s * 1e3:.0f} ms, simulated {p.simulated_ttft_s * 1e3:.0f} ms")
    added = served.meta["served"]
    print(f"added {added['added_step_s'] * 1e3:.2f} ms/step + {added['added_seq_s'] * 1e6:.1f} "
          f"us/seq + {added['added_token_s'] * 1e6:.1f} us/token fed; wrote {output}")
    for users, (tpot, ttft) in added["fitted_tpot_ttft_s"].items():
        print(f"{users} users, served profile: TPOT {tpot * 1e3:.1f} ms, median TTFT "
              f"{ttft * 1e3:.0f} ms")
    return 0
