"""Native kernels, compiled on first use with the machine's C++ compiler.

Decode attention over the paged KV cache is the one place where torch has no good CPU
primitive: gathering each request's blocks into a padded tensor for SDPA copies the whole
context, twice, per layer and step. `csrc/paged_attention.cpp` reads K/V straight from the
blocks instead. If it cannot be built (no compiler), the engine falls back to the torch path
and says so once.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


@functools.cache
def paged_attention_ops() -> ModuleType | None:
    """The compiled extension (cached under TORCH_EXTENSIONS_DIR), or None if it fails."""
    from torch.utils.cpp_extension import load

    try:
        return load(name="loom_paged_attention", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], verbose=bool(os.environ.get("LOOM_VERBOSE_BUILD")))
    except Exception as e:  # noqa: BLE001 - compiler missing or failing: fall back, loudly
        logger.warning("could not build the C++ paged-attention kernel (%s: %s); using the "
                       "slower torch attention path", type(e).__name__, e)
        return None
