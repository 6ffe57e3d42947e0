"""CPU memory on transparent huge pages, for what the model streams whole: the KV cache and the
native matmul's weight panels.

On 4 KB pages a stream of hundreds of megabytes crosses a page boundary every 4 KB: the
hardware prefetcher stops at each one and every page costs a TLB walk. On 2 MB pages the
matmuls of a one-row decode step run measurably faster, and a prefill's first pass through
fresh KV blocks takes far fewer page faults (BENCHMARKS.md has both). Linux backs a mapping
advised MADV_HUGEPAGE with huge pages when its THP setting is `madvise` or `always`; elsewhere
the same memory is plain pages.

The memory comes from anonymous mappings, zeroed by the OS on first touch: a cache of gigabytes
costs nothing at start-up, and memory is taken as it is used.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE = 2 << 20
_ARENA_CHUNK = 64 << 20  # at least, per mapping of an Arena
_ALIGN = 64  # a cache line: each tensor an Arena hands out starts on one


def zeroed(nbytes: int) -> torch.Tensor:
    """A zero uint8 tensor of `nbytes` starting on a huge-page boundary, in a mapping of its own
    advised MADV_HUGEPAGE (the tensor keeps the mapping alive)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; a no-op where THP is off
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mapping, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE  # whole huge pages from the first byte on
    return torch.from_numpy(raw[start:start + nbytes])


class Arena:
    """Many tensors cut from a few huge-page mappings. A mapping each would round every tensor
    up to whole huge pages: a small model's projections are each under one, so its panels would
    take several times their size. A mapping lives as long as any tensor cut from it."""

    def __init__(self, chunk_bytes: int = _ARENA_CHUNK) -> None:
        self._chunk_bytes = chunk_bytes
        self._free = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        """A zero uint8 tensor of `nbytes`, cache-line aligned."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        if size > self._free.numel():
            self._free = zeroed(max(self._chunk_bytes, size))
        taken, self._free = self._free[:nbytes], self._free[size:]
        return taken


def thp_enabled() -> bool:
    """Whether this OS backs mappings advised MADV_HUGEPAGE with transparent huge pages."""
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


def thp_eligible(tensor: torch.Tensor) -> bool | None:
    """Whether the mapping holding `tensor`'s first byte may be backed by transparent huge pages
    (`THPeligible` in Linux's /proc/self/smaps); None where the OS does not say."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    address, inside = tensor.data_ptr(), False
    for line in smaps.read_text().splitlines():
        first = line.split()[0]
        if "-" in first and all(c in "0123456789abcdef-" for c in first):
            low, high = (int(x, 16) for x in first.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None
