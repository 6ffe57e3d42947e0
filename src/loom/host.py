"""What this machine is: CPU model and features, usable cores, memory. Read from /proc once per
call, torch-free, so the engine, `loom bench` and the benchmarks describe a host the same way.
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path
from typing import Any

_NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def read_text(path: str) -> str:
    """A /proc (or any) file's text, or "" where it cannot be read."""
    try:
        return Path(path).read_text()
    except OSError:
        return ""


@cache
def cpu_model() -> str:
    for line in read_text("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags (x86 `flags`, Arm `Features`)."""
    for line in read_text("/proc/cpuinfo").splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_native_bf16() -> bool:
    """bf16 dot-product instructions (x86 avx512_bf16 / AMX, Arm bf16): there bf16 matmuls run
    several times faster than fp32; without them bf16 is emulated and slow."""
    return bool(cpu_flags() & _NATIVE_BF16_FLAGS)


def has_amx() -> bool:
    """Intel's AMX tile units (bf16 / int8 matrix multiplies): oneDNN's bf16 matmuls run on
    them, several times the AVX-512 bf16 rate (on AMD's AVX-512 bf16 parts there are none)."""
    return "amx_bf16" in cpu_flags()


def simd_level() -> str:
    """The widest x86 vector extension the kernels can use: avx512, avx2 or none."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "none"


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask), not the machine's total."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def meminfo_bytes(key: str) -> int | None:
    """A /proc/meminfo field (MemTotal, MemAvailable, ...) in bytes, None where absent."""
    for line in read_text("/proc/meminfo").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def available_ram_bytes() -> int:
    """Memory a new allocation can get without swapping (MemAvailable), else all of it."""
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def describe() -> str:
    """One line naming the host, for logs and benchmark tables: model, cores, SIMD, RAM."""
    total = meminfo_bytes("MemTotal")
    ram = f", {total / 2**30:.0f} GiB" if total else ""
    bf16 = (", native bf16" + (" (AMX)" if has_amx() else "")) if has_native_bf16() else ""
    return f"{cpu_model()}, {usable_cpus()} cores, {simd_level()}{bf16}{ram}"


def hardware() -> dict[str, Any]:
    """This machine as a record (CPU, cores, RAM); GPUs are added by the caller that knows."""
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable_cpus(),
        "simd": simd_level(),
        "native_bf16": has_native_bf16(),
        "amx": has_amx(),
        "ram_bytes": meminfo_bytes("MemTotal"),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
