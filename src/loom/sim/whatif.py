"""The what-if across GPUs: simulate each (GPU, TP) configuration on the same trace and loads,
price it per accepted answer, and name the cheapest one that meets the SLO, with the
commands to benchmark it for real (it is a model, not a measurement)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from loom.sim.result import SimConfig, simulate_run
from loom.workload.figures import request_figures
from loom.workload.load import Load
from loom.workload.results import ConfigInfo, Limits, SweepResult
from loom.workload.slo import Slo
from loom.workload.trace import Trace


def simulate_sweep(config: SimConfig, trace: Trace, token_ids: list[list[int]],
                   loads: list[Load], slo: Slo | None, limits: Limits | None = None,
                   scrape_interval_s: float = 1.0) -> SweepResult:
    """Every load on one configuration, as a `loom bench sweep` result (all points run:
    simulating past the knee costs seconds, not minutes)."""
    limits = Limits() if limits is None else limits
    runs = []
    for load in loads:
        run = simulate_run(config, trace, token_ids, load, slo,
                           f"simulated {config.name} {load.point_name}", scrape_interval_s)
        runs.append(replace(run, limits_crossed=limits.crossed(run)))
    within = [load.rate for load, r in zip(loads, runs) if not r.limits_crossed
              and isinstance(load.rate, (int, float)) and math.isfinite(load.rate)]
    return SweepResult(f"simulated {config.name}", runs, max(within, default=None), "rate",
                       limits, trace.describe(),
                       ConfigInfo(config.name, " ".join(config.flags()),
                                  config.serve_commands.get("loom")
                                  or config.serve_commands.get("vllm")), simulated=True)


@dataclass(frozen=True)
class CostRow:
    """One configuration at one load, priced: $ per accepted answer (good answers under the
    SLO, else completed ones) at price x GPUs, and whether the SLO was met."""

    config: str
    gpu: str | None
    num_gpus: int
    run: str
    point: tuple[Any, Any]
    accepted: int
    usd_per_hour: float | None
    usd_per_accepted_answer: float | None
    slo_met: bool | None
    serve_commands: dict[str, str | None]


def cost_rows(sweeps: list[SweepResult], configs: list[SimConfig],
              prices: dict[str, float], slo: Slo | None) -> list[CostRow]:
    """Per configuration and load: its price per accepted answer (CostRow)."""
    rows = []
    for sweep, config in zip(sweeps, configs):
        gpu = config.profile.meta.get("gpu", {}).get("key")
        price = prices.get(gpu) if gpu else None
        for run in sweep.runs:
            goodput = request_figures(run.requests, run.duration, slo).goodput if slo else None
            accepted = goodput.good if goodput else run.figures.completed
            per_hour = None if price is None else price * config.num_gpus
            cost = (per_hour * run.duration / 3600 / accepted
                    if per_hour is not None and accepted else None)
            rows.append(CostRow(config.name, gpu, config.num_gpus, run.label or "", run.point,
                                accepted, per_hour, cost, goodput.slo_met if goodput else None,
                                config.serve_commands))
    return rows


def cheapest(rows: list[CostRow]) -> dict[tuple[Any, Any], CostRow]:
    """Per offered load, the priced row with the lowest cost per accepted answer among those
    that meet the SLO (or all priced rows when no SLO is given)."""
    best: dict[tuple[Any, Any], CostRow] = {}
    for row in rows:
        cost = row.usd_per_accepted_answer
        if cost is None or row.slo_met is False:
            continue
        if row.point not in best or cost < best[row.point].usd_per_accepted_answer:
            best[row.point] = row
    return best
