"""The machine a result was measured on, and a local server process's memory.

A figure means little without its hardware, and a run's peak memory is part of its cost. The
host is described by `loom.host` (as the engine and the benchmarks describe it); GPUs come
from nvidia-smi where present, process memory from /proc. Nothing here talks to the server.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from loom import host


def hardware() -> dict[str, Any]:
    """CPU model, cores, RAM and GPUs of this (the benchmarking) machine."""
    return {**host.hardware(),
            "gpus": _nvidia_smi(["--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                lambda f: {"name": f[0], "memory_bytes": int(float(f[1])) * 2**20})}


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (a server may run its engine in child processes)."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            todo += [int(c) for c in host.read_text(str(task)).split()]
    return tree


def process_memory(pid: int) -> dict[str, int] | None:
    """Resident memory of a process tree now (VmRSS) and at its peak (VmHWM), plus GPU memory
    its processes hold, in bytes; None once the process is gone."""
    pids = process_tree(pid)
    rss = hwm = 0
    for p in pids:
        status = host.read_text(f"/proc/{p}/status")
        if not status and p == pid:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss += _kib(fields.get("VmRSS"))
        hwm += _kib(fields.get("VmHWM"))
    gpu = _nvidia_smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                      lambda f: (int(f[0]), int(float(f[1])) * 2**20))
    return {"rss_bytes": rss, "hwm_bytes": hwm,
            "gpu_bytes": sum(used for p, used in gpu if p in pids)}


def _kib(field: str | None) -> int:
    return int(field.split()[0]) * 1024 if field else 0


def _nvidia_smi(args: list[str], parse: Any) -> list[Any]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.stdout.splitlines():
        try:
            rows.append(parse([f.strip() for f in line.split(",")]))
        except (ValueError, IndexError):
            continue
    return rows
