"""Step-time profiles: a `StepModel` plus the model and KV cache it describes, saved as JSON.

Two sources: `roofline` (from the GPU catalogue and the model's shape, for GPUs not here; the
efficiency factors are stated in the file) and `calibrated` (fitted by `loom simulate
calibrate` to loom's own steps on this machine, with the fit's held-out error).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loom.plan.catalogue import GpuSpec, PlanError
from loom.plan.models import PlanModel
from loom.plan.planner import PlanSettings, capacity
from loom.plan.roofline import StepModel

PROFILE_KIND = "loom-step-profile"
PROFILE_VERSION = 1
# engine options a calibrated profile's step times depend on (the cache's size and the
# scheduler's flags are the simulation's own, from SimConfig.flags)
_TIMING_OPTIONS = ("model", "dtype", "device", "num_threads", "attention_backend",
                   "linear_backend", "batched_matmul", "kv_cache_dtype")


@dataclass(frozen=True)
class Profile:
    """What `loom simulate` needs to stand in for the engine: step times and the cache."""

    source: Literal["roofline", "calibrated"]
    step_model: StepModel
    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    num_gpus: int = 1
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"kind": PROFILE_KIND, "version": PROFILE_VERSION, "source": self.source,
                "model": self.model, "max_model_len": self.max_model_len,
                "num_kv_blocks": self.num_kv_blocks, "block_size": self.block_size,
                "num_gpus": self.num_gpus, "step_model": self.step_model.to_json(),
                "meta": self.meta}

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "profile") -> Profile:
        if obj.get("kind") != PROFILE_KIND:
            raise PlanError(f"{where}: not a loom step profile (kind {obj.get('kind')!r})")
        try:
            return cls(source=obj["source"], step_model=StepModel.from_json(obj["step_model"]),
                       model=obj["model"], max_model_len=obj["max_model_len"],
                       num_kv_blocks=obj["num_kv_blocks"], block_size=obj["block_size"],
                       num_gpus=obj.get("num_gpus", 1), meta=obj.get("meta", {}))
        except (KeyError, TypeError) as e:
            raise PlanError(f"{where}: malformed profile ({e})") from None

    def engine_flags(self) -> list[str]:
        """The `loom serve` flags that reproduce the engine a calibrated profile timed: its
        model and thread count, and the model / KV options it ran with away from their
        defaults (step times depend on every one of them). None for a roofline profile."""
        from loom.config import CacheConfig, ModelConfig, flag_name

        engine = self.meta.get("engine_config", {})
        out = []
        for cls, section in ((ModelConfig, "model"), (CacheConfig, "cache")):
            given = engine.get(section, {})
            for f in dataclasses.fields(cls):
                if f.name in _TIMING_OPTIONS and given.get(f.name, f.default) != f.default:
                    out += [flag_name(f), str(given[f.name])]
        threads = self.meta.get("num_threads")
        if threads and "--num-threads" not in out:
            out += ["--num-threads", str(threads)]
        return out

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            obj = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"cannot read profile {str(path)!r}: {e}") from None
        return cls.from_json(obj, str(path))


def roofline_profile(model: PlanModel, gpu: GpuSpec, tp: int, s: PlanSettings) -> Profile:
    """The roofline profile of `model` on `tp` x `gpu`, its KV capacity from `loom plan`."""
    cap = capacity(model, gpu, tp, s)
    if cap.num_blocks < 1:
        raise PlanError(f"{model.name} does not fit {tp} x {gpu.key}: no memory left for "
                        "the KV cache")
    return Profile(source="roofline", step_model=cap.step_model, model=model.name,
                   max_model_len=s.max_model_len, num_kv_blocks=cap.num_blocks,
                   block_size=s.block_size, num_gpus=tp,
                   meta={"gpu": gpu.to_json(), "tensor_parallel_size": tp,
                         "weight_dtype": s.weight_dtype, "kv_dtype": s.kv_dtype,
                         "efficiency": vars(s.efficiency),
                         "date": datetime.date.today().isoformat()})
