"""Native kernels, compiled on first use with the machine's C++ compiler.

Two places where torch has no good CPU primitive:
- decode attention over the paged KV cache: gathering each request's blocks into a padded
  tensor for SDPA copies the whole context, twice, per layer and step.
  `csrc/paged_attention.cpp` reads K/V straight from the blocks instead.
- small-batch matmuls with a GGUF's block-quantized weights: torch's int8/int4 weight-only
  matmuls have no AVX2 path (20-100x slower than fp32 here), and its dynamic int8 matmul
  quantizes activations per tensor, which cost this model half its top-1 agreement.
  `csrc/block_quant_linear.cpp` computes with the file's own codes, in fp32.
If one cannot be built (no compiler), the engine falls back to the torch path and says so once.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"


@functools.cache
def paged_attention_ops() -> ModuleType | None:
    """The compiled decode-attention extension, or None if it fails to build."""
    return _build("loom_paged_attention", "paged_attention.cpp", "paged-attention kernel",
                  "attention")


@functools.cache
def block_quant_linear_ops() -> ModuleType | None:
    """The compiled block-quantized matmul extension, or None if it fails to build."""
    return _build("loom_block_quant_linear", "block_quant_linear.cpp",
                  "block-quantized matmul kernel", "oneDNN matmul")


def _build(name: str, source: str, what: str, fallback: str) -> ModuleType | None:
    """Compile (once; cached under TORCH_EXTENSIONS_DIR) and import an extension."""
    from torch.utils.cpp_extension import load

    try:
        return load(name=name, sources=[str(_CSRC / source)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], verbose=bool(os.environ.get("LOOM_VERBOSE_BUILD")))
    except Exception as e:  # noqa: BLE001 - compiler missing or failing: fall back, loudly
        logger.warning("could not build the C++ %s (%s: %s); using the slower %s path", what,
                       type(e).__name__, e, fallback)
        return None
