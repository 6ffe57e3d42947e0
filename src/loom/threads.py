"""CPU threads for torch. (Stand-in: the serving-hardening work replaces this policy.)"""

from __future__ import annotations

from loom import host


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count (default: the cores this process may use) and
    return it."""
    import torch

    count = num_threads or host.usable_cpus()
    torch.set_num_threads(count)
    return count
