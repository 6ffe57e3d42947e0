"""Step-model efficiency terms fitted to published measurements, per serving engine and GPU
(fitted_profiles.json, written by `loom simulate calibrate --published`).

A what-if names the engine whose behaviour it assumes (`loom simulate --engine`): its terms
for the GPU when that GPU had enough published rows, else its GPU generation's, else the
stated roofline assumptions (`Efficiency()`), and says which it used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from loom.plan.catalogue import PlanError
from loom.plan.published import ENGINES
from loom.plan.roofline import Efficiency

GENERATIONS = {"h100-sxm": "hopper", "h100-pcie": "hopper", "h100-nvl": "hopper",
               "h200": "hopper", "gh200": "hopper", "a100-80gb": "ampere",
               "a100-40gb": "ampere", "a10g": "ampere", "l40s": "ada", "l4": "ada",
               "rtx-4090": "ada", "b200": "blackwell", "b300": "blackwell",
               "rtx-5090": "blackwell"}
FILE = "fitted_profiles.json"


def generation(gpu: str) -> str:
    return GENERATIONS.get(gpu, "unknown")


@dataclass(frozen=True)
class ErrorBand:
    """Mean |error| on the held-out rows, percent (None: no held-out figure of that kind)."""

    throughput_pct: float | None
    ttft_pct: float | None
    tpot_pct: float | None
    rows: int
    scope: str = ""  # what kind of runs the rows are (a band says nothing beyond them)
    latency_pct: float | None = None  # mean end-to-end request latency

    def describe(self) -> str:
        def pct(x: float | None) -> str:
            return f"±{x:.0f}%" if x is not None else "not published"

        return (f"expected error: throughput {pct(self.throughput_pct)}, TTFT "
                f"{pct(self.ttft_pct)}, TPOT {pct(self.tpot_pct)}"
                + (f", latency {pct(self.latency_pct)}" if self.latency_pct is not None else "")
                + f" (held-out, {self.rows} rows"
                + (f": {self.scope})" if self.scope else ")"))


@dataclass(frozen=True)
class FittedProfiles:
    """engine -> GPU key or generation -> {"efficiency": {...}, "train_rows": n, ...}."""

    profiles: dict[str, dict[str, dict[str, Any]]]
    held_out: dict[str, ErrorBand] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def efficiency(self, engine: str, gpu: str) -> tuple[Efficiency, str]:
        """(the terms for `engine` on `gpu`, where they come from). Another engine's fit is
        never borrowed: TensorRT-LLM's fitted per-step overhead stands in for what its offline
        rows' large batches cost and overstates a small batch's latency several-fold
        (BENCHMARKS.md, the vLLM rows)."""
        check_engine(engine)
        mine = self.profiles.get(engine, {})
        for key, what in ((gpu, f"fitted to {engine} on {gpu}"),
                          (generation(gpu), f"fitted to {engine} on {generation(gpu)} GPUs")):
            if key in mine:
                return Efficiency(**mine[key]["efficiency"]), what
        return Efficiency(), f"roofline assumptions (no published {engine} rows for {gpu})"

    def band(self, engine: str) -> ErrorBand | None:
        return self.held_out.get(engine)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "loom-fitted-profiles", "profiles": self.profiles,
                "held_out": {k: vars(v) for k, v in self.held_out.items()}, "meta": self.meta}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FittedProfiles:
        return cls(obj["profiles"], {k: ErrorBand(**v) for k, v in obj["held_out"].items()},
                   obj.get("meta", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise PlanError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")


def shipped_profiles() -> FittedProfiles:
    """The fitted profiles in the package (empty before the first fit)."""
    path = resources.files("loom.plan").joinpath(FILE)
    if not path.is_file():
        return FittedProfiles({})
    return FittedProfiles.from_json(json.loads(path.read_text()))
