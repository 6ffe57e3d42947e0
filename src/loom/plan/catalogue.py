"""The GPU catalogue: datasheet figures shipped as package data (gpus.json, a source for every
number), user-supplied entries (`--gpu-spec FILE`, the same JSON shape) and "this" machine,
measured on the spot. Prices are never part of it: they depend on provider, region and date,
so they come only from `--price`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from loom import host

THIS_MACHINE = "this"
_FIELDS = ("memory_gb", "memory_bandwidth_gbs", "bf16_tflops")
_OPTIONAL = ("fp8_tflops", "fp4_tflops", "driver_memory_gib", "interconnect_gbs")
FP4_DTYPES = ("nvfp4", "mxfp4")


class PlanError(ValueError):
    """Bad planning input: an unknown GPU or model, an impossible split, a malformed file."""


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator as the planner sees it. `fp8_tflops` / `fp4_tflops` are None where
    the chip has no such tensor cores. `driver_memory_gib`: what the driver exposes (ECC and
    reserved memory taken out), where a published figure gives it."""

    key: str
    name: str
    memory_gb: float
    memory_bandwidth_gbs: float
    bf16_tflops: float
    fp8_tflops: float | None = None
    fp4_tflops: float | None = None
    driver_memory_gib: float | None = None
    interconnect: str = "none"
    interconnect_gbs: float | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def memory_bytes(self) -> int:
        """What a process can allocate: the driver's figure, else the vendor's GB read as
        binary GiB (see gpus.json's note)."""
        return int((self.driver_memory_gib or self.memory_gb) * 2**30)

    def tflops(self, weight_dtype: str) -> float:
        """Dense tensor FLOP/s a matmul with these weights can reach at best. fp8 and int8
        (W8A8) run on 8-bit tensor cores where the chip has them, fp4 (NVFP4 / MXFP4) on 4-bit
        ones; int4, and fp4 on a chip without fp4 tensor cores, is weight-only (AWQ / GPTQ /
        Marlin kernels): weights are expanded to 16-bit and multiplied at the bf16 rate, so
        only its memory reads shrink."""
        if weight_dtype in ("fp8", "int8") and self.fp8_tflops:
            return self.fp8_tflops
        if weight_dtype in FP4_DTYPES and self.fp4_tflops:
            return self.fp4_tflops
        return self.bf16_tflops

    def fp4_note(self, weight_dtype: str) -> str | None:
        """Why fp4 weights on this chip compute at the 16-bit rate, or None."""
        if weight_dtype not in FP4_DTYPES or self.fp4_tflops:
            return None
        return (f"{self.key} has no fp4 tensor cores: {weight_dtype} weights are dequantized "
                "to 16-bit (weight-only kernels, e.g. vLLM's Marlin FP4): reads shrink, "
                "matmuls run at the bf16 rate")

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "memory_gb": self.memory_gb,
                "memory_bandwidth_gbs": self.memory_bandwidth_gbs,
                "bf16_tflops": self.bf16_tflops, "fp8_tflops": self.fp8_tflops,
                "fp4_tflops": self.fp4_tflops, "driver_memory_gib": self.driver_memory_gib,
                "interconnect": self.interconnect, "interconnect_gbs": self.interconnect_gbs,
                "sources": self.sources}


def _spec(key: str, entry: dict[str, Any], where: str) -> GpuSpec:
    missing = [f for f in _FIELDS if not isinstance(entry.get(f), (int, float))]
    if missing:
        raise PlanError(f"{where}: GPU {key!r} needs numeric {', '.join(missing)}")
    bad = [f for f in _FIELDS if entry[f] <= 0]
    if bad:
        raise PlanError(f"{where}: GPU {key!r}: {', '.join(bad)} must be > 0")
    bad = [f for f in _OPTIONAL if entry.get(f) is not None
           and (not isinstance(entry[f], (int, float)) or entry[f] <= 0)]
    if bad:
        raise PlanError(f"{where}: GPU {key!r}: {', '.join(bad)} must be a number > 0 or null")
    return GpuSpec(key=key, name=entry.get("name", key), memory_gb=entry["memory_gb"],
                   memory_bandwidth_gbs=entry["memory_bandwidth_gbs"],
                   bf16_tflops=entry["bf16_tflops"], fp8_tflops=entry.get("fp8_tflops"),
                   fp4_tflops=entry.get("fp4_tflops"),
                   driver_memory_gib=entry.get("driver_memory_gib"),
                   interconnect=entry.get("interconnect", "none"),
                   interconnect_gbs=entry.get("interconnect_gbs"),
                   sources=dict(entry.get("sources", {})))


def _entries(text: str, where: str) -> dict[str, GpuSpec]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise PlanError(f"{where}: not JSON ({e})") from None
    gpus = data.get("gpus") if isinstance(data, dict) else None
    if not isinstance(gpus, dict) or not gpus:
        raise PlanError(f'{where}: expected {{"gpus": {{"name": {{"memory_gb": ..., ...}}}}}}')
    return {key.lower(): _spec(key.lower(), entry, where) for key, entry in gpus.items()}


def builtin_catalogue() -> dict[str, GpuSpec]:
    text = resources.files("loom.plan").joinpath("gpus.json").read_text()
    return _entries(text, "loom/plan/gpus.json")


def load_catalogue(extra_files: list[str] | None = None) -> dict[str, GpuSpec]:
    """The shipped catalogue plus user files (a user entry replaces a shipped one)."""
    catalogue = builtin_catalogue()
    for path in extra_files or []:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanError(f"cannot read GPU spec file {path!r}: {e}") from None
        catalogue.update(_entries(text, path))
    return catalogue


def resolve_gpus(names: list[str], catalogue: dict[str, GpuSpec],
                 measure: Callable[[], GpuSpec] | None = None) -> list[GpuSpec]:
    """The named GPUs; "this" is measured (once) unless a file defined it."""
    out = []
    for name in names:
        key = name.strip().lower()
        if key == THIS_MACHINE and key not in catalogue:
            catalogue[key] = (measure or measure_this_machine)()
        if key not in catalogue:
            raise PlanError(f"unknown GPU {name!r}; known: {', '.join(sorted(catalogue))}, "
                            f"{THIS_MACHINE} (measured), or add one with --gpu-spec FILE")
        out.append(catalogue[key])
    return out


def measure_this_machine(size_mib: int = 256, matmul_n: int = 1024) -> GpuSpec:
    """This host as an accelerator: available RAM, a timed read of `size_mib` (numpy, one
    thread: a floor on what the cores together reach) and float32 matmul FLOP/s (BLAS, all
    cores). A CPU has no bf16/fp8 tensor units here, so float32 stands in for both."""
    import numpy as np

    data = np.ones(size_mib * 2**20 // 4, dtype=np.float32)
    read_s = _best_of(data.sum, 3)
    a = np.ones((matmul_n, matmul_n), dtype=np.float32)
    matmul_s = _best_of(lambda: a @ a, 3)
    bandwidth_gbs = data.nbytes / read_s / 1e9
    tflops = 2 * matmul_n**3 / matmul_s / 1e12
    how = f"measured {time.strftime('%Y-%m-%d')} on {host.describe()}"
    return GpuSpec(
        key=THIS_MACHINE, name=f"this machine ({host.cpu_model()})",
        memory_gb=host.available_ram_bytes() / 2**30, memory_bandwidth_gbs=bandwidth_gbs,
        bf16_tflops=tflops, fp8_tflops=None, interconnect="none",
        sources={"memory_gb": f"MemAvailable, {how}",
                 "memory_bandwidth_gbs": f"numpy sum over {size_mib} MiB, best of 3, {how}",
                 "bf16_tflops": f"float32 {matmul_n}x{matmul_n} matmul, best of 3, {how}"})


def _best_of(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def parse_prices(text: str | None) -> dict[str, float]:
    """'h100-sxm=2.4,h200=3.1' ($ per GPU-hour, as you were quoted) -> {gpu: price}."""
    prices: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or price < 0:
            raise PlanError(f"bad --price term {part!r}; use e.g. h100-sxm=2.4 ($ per GPU-hour)")
        prices[key.strip().lower()] = price
    return prices


def check_prices(prices: dict[str, float], gpus: list[str]) -> None:
    """A price for a GPU that is not planned would be dropped without a word: a typo in a
    name then looks like a GPU without a price."""
    unused = sorted(set(prices) - set(gpus))
    if unused:
        raise PlanError(f"--price names {', '.join(unused)}, not among the GPUs planned "
                        f"({', '.join(gpus) or 'none'}); add it to --gpus or drop its price")
