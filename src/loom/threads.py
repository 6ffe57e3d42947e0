"""CPU threads for torch: how many, and how they wait for each other.

torch's intra-op threads (libgomp's OpenMP pool, which loom's C++ kernels share) meet at a
barrier after every parallel op, hundreds of times per decode step. By default a thread that
arrives first spins, burning its core, until its peers arrive. On a quiet machine that saves a
wake-up; on one busy with other programs a peer is often descheduled, and the spinning thread
burns the very timeslice the peer needed: decode then slows by far more than the CPU share it
lost (see benchmarks/engine/busy_machine.py). With OMP_WAIT_POLICY=PASSIVE waiting threads
sleep, and loom slows in proportion to the CPU it still gets.

loom's own kernels (the block-quantized matmul, decode attention: most of a decode step's
parallel calls) do not go through that pool: their helpers (csrc/parallel_dynamic.h) wait by
yielding the core between calls, which costs no wake-up on a quiet machine, and go back to
sleeping between calls when a busy one makes them miss their turn.

libgomp reads OMP_WAIT_POLICY once, when torch loads, so `import loom` sets the default
(`default_wait_policy`) before anything imports torch. A value the user set is kept, and so is
whatever torch read if it was imported before loom.
"""

from __future__ import annotations

import logging
import os
import sys

from loom import host

logger = logging.getLogger(__name__)

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"

_torch_loaded_first = False  # torch was imported before loom could set the wait policy


def default_wait_policy() -> None:
    """Make OMP_WAIT_POLICY=PASSIVE the default for the torch this process will load."""
    global _torch_loaded_first
    _torch_loaded_first = "torch" in sys.modules and WAIT_POLICY_ENV not in os.environ
    os.environ.setdefault(WAIT_POLICY_ENV, DEFAULT_WAIT_POLICY)


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count (default: the cores this process may use) and
    return it."""
    import torch

    count = num_threads or host.usable_cpus()
    torch.set_num_threads(count)
    if _torch_loaded_first and count > 1:
        logger.warning("torch was imported before loom, so its threads spin-wait (libgomp's "
                       "default): on a busy machine decoding can slow far more than its share "
                       "of the CPU. Import loom first, or set %s=%s before starting Python.",
                       WAIT_POLICY_ENV, DEFAULT_WAIT_POLICY)
    return count
