"""The what-if across GPUs: simulate each (GPU, TP) configuration on the same trace and loads,
price it per accepted answer, and name the cheapest one that meets the SLO, with the
commands to benchmark it for real (it is a model, not a measurement)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loom.bench.replay import Load
from loom.bench.results import Slo, request_figures, requests_of
from loom.bench.sweep import Limits
from loom.bench.trace import Trace
from loom.sim.result import SimConfig, simulate_run


@dataclass(frozen=True)
class Point:
    """One offered load: a rate (req/s, inf) and optionally a cap on users in flight."""

    rate: float | str  # req/s, math.inf or "trace"
    max_concurrency: int | None = None

    @property
    def name(self) -> str:
        if self.rate == "trace":
            return "trace arrivals"
        if math.isinf(self.rate):
            return f"x{self.max_concurrency}" if self.max_concurrency else "all at once"
        return f"@{self.rate:g}/s"


def sweep_config(config: SimConfig, trace: Trace, token_ids: list[list[int]], base: Load,
                 points: list[Point], limits: Limits, slo: Slo | None,
                 scrape_interval_s: float = 1.0) -> dict[str, Any]:
    """Every point on one configuration, as a `loom bench sweep` JSON (all points run:
    simulating past the knee costs seconds, not minutes)."""
    runs = []
    for p in points:
        load = Load(rate=p.rate, burstiness=base.burstiness,
                    max_concurrency=p.max_concurrency or base.max_concurrency,
                    duration_s=base.duration_s, num_requests=base.num_requests, seed=base.seed)
        run = simulate_run(config, trace, token_ids, load, slo,
                           f"simulated {config.name} {p.name}", scrape_interval_s)
        run["limits_crossed"] = limits.crossed(run)
        runs.append(run)
    within = [p.rate for p, r in zip(points, runs) if not r["limits_crossed"]
              and isinstance(p.rate, (int, float)) and math.isfinite(p.rate)]
    return {"kind": "sweep", "label": f"simulated {config.name}", "simulated": True,
            "limits": vars(limits), "points": "rate", "knee_rate": max(within, default=None),
            "trace": trace.describe(), "runs": runs,
            "config": {"name": config.name, "flags": " ".join(config.flags()),
                       "server_command": config.serve_commands.get("loom")
                       or config.serve_commands.get("vllm")}}


def cost_rows(sweeps: list[dict[str, Any]], configs: list[SimConfig],
              prices: dict[str, float], slo: Slo | None) -> list[dict[str, Any]]:
    """Per configuration and load: $ per accepted answer (good answers under the SLO, else
    completed ones) at price x GPUs, and whether the SLO was met."""
    rows = []
    for sweep, config in zip(sweeps, configs):
        gpu = config.profile.meta.get("gpu", {}).get("key")
        price = prices.get(gpu) if gpu else None
        for run in sweep["runs"]:
            goodput = request_figures(requests_of(run), run["duration"], slo)["goodput"] \
                if slo else None
            accepted = goodput["good"] if goodput else run["completed"]
            per_hour = None if price is None else price * config.num_gpus
            cost = (per_hour * run["duration"] / 3600 / accepted
                    if per_hour is not None and accepted else None)
            rows.append({"config": config.name, "gpu": gpu, "num_gpus": config.num_gpus,
                         "run": run["label"], "request_rate": run["request_rate"],
                         "max_concurrency": run.get("max_concurrency"),
                         "accepted": accepted, "usd_per_hour": per_hour,
                         "usd_per_accepted_answer": cost,
                         "slo_met": goodput["slo_met"] if goodput else None,
                         "serve_commands": config.serve_commands})
    return rows


def cheapest(rows: list[dict[str, Any]]) -> dict[tuple[Any, Any], dict[str, Any]]:
    """Per offered load, the priced row with the lowest cost per accepted answer among those
    that meet the SLO (or all priced rows when no SLO is given)."""
    best: dict[tuple[Any, Any], dict[str, Any]] = {}
    for row in rows:
        if row["usd_per_accepted_answer"] is None or row["slo_met"] is False:
            continue
        key = (row["request_rate"], row["max_concurrency"])
        if key not in best or row["usd_per_accepted_answer"] < best[key][
                "usd_per_accepted_answer"]:
            best[key] = row
    return best
