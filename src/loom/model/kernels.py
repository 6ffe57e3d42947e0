"""Native kernels, compiled on first use with the machine's C++ compiler.

Three places where torch has no good CPU primitive:
- decode attention over the paged KV cache: gathering each request's blocks into a padded
  tensor for SDPA copies the whole context, twice, per layer and step.
  `csrc/paged_attention.cpp` reads K/V straight from the blocks instead.
- matmuls with a GGUF's block-quantized weights: torch's int8/int4 weight-only matmuls have no
  AVX2 path (far slower than fp32 here), and its dynamic int8 matmul quantizes activations per
  tensor, which cost this model half its top-1 agreement. `csrc/block_quant_linear.cpp`
  computes with the file's own codes: decode-sized steps with activations split into two int8
  parts per block of 32 (integer dot products), larger ones in fp32. The same extension
  runs a mixture-of-experts layer's chosen experts in one call (model/moe.py), on the same
  tiles.
- the elementwise glue between matmuls (residual add + RMSNorm, SiLU * up): torch runs an
  RMSNorm as about eight ops. `csrc/fused_ops.cpp` makes each one pass.
And one at load: `csrc/gguf_blocks.cpp` converts the GGUF types the block-quantized matmul does
not read into ones it does (model/requant.py), in one pass over the bytes.
If one cannot be built (no compiler), the engine falls back to the torch path and says so once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
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


@functools.cache
def gguf_blocks_ops() -> ModuleType | None:
    """The compiled GGUF block conversion (model/requant.py), or None if it fails to build."""
    return _build("loom_gguf_blocks", "gguf_blocks.cpp", "GGUF block conversion",
                  "dequantized fp32", exact_math=True)


@functools.cache
def fused_ops() -> ModuleType | None:
    """The compiled add + RMSNorm and SiLU * up extension, or None if it fails to build."""
    return _build("loom_fused_ops", "fused_ops.cpp", "fused norm kernel", "torch elementwise")


def _build_directory(name: str) -> Path:
    """Where an extension is built: under TORCH_EXTENSIONS_DIR (default
    ~/.cache/torch_extensions), one folder per Python environment and source checkout. The
    build files name the environment's torch headers and the source's path, so two virtualenvs,
    or two checkouts run from one virtualenv (an A/B from a git worktree), sharing a folder
    rebuilt each other's kernels (a minute or more) on every start."""
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    env = hashlib.sha256(f"{sys.prefix}|{torch.__version__}|{_CSRC.resolve()}".encode()
                         ).hexdigest()[:12]
    path = Path(root) / f"loom-{env}" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_LDFLAGS = ["-fopenmp"]


def _build(name: str, source: str, what: str, fallback: str,
           exact_math: bool = False) -> ModuleType | None:
    """Compile (once; cached, see _build_directory) and import an extension. A build this
    source and these flags already made is imported straight from its .so: asking
    torch.utils.cpp_extension (importing it and setuptools, running ninja to check) took
    longer than the rest of making the model. exact_math: IEEE arithmetic, without
    -ffast-math's rewrites (which may, for one, divide by multiplying with a reciprocal) and
    without fusing a multiply and an add into one rounding."""
    directory = _build_directory(name)
    library, stamp = directory / f"{name}.so", directory / f"{name}.loom-stamp"
    cflags = [*_CFLAGS, "-fno-fast-math", "-ffp-contract=off"] if exact_math else _CFLAGS
    key = _source_key(source, cflags)
    if library.exists() and stamp.exists() and stamp.read_text() == key:
        try:
            return _join_pool(_import_library(name, library))
        except ImportError as e:  # e.g. a half-written file: build again below
            logger.debug("rebuilding the %s: %s", what, e)
    from torch.utils.cpp_extension import load

    with _build_lock(directory):
        try:
            module = load(name=name, sources=[str(_CSRC / source)],
                          build_directory=str(directory), extra_cflags=cflags,
                          extra_ldflags=_LDFLAGS,
                          verbose=bool(os.environ.get("LOOM_VERBOSE_BUILD")))
        except Exception as e:  # noqa: BLE001 - compiler missing or failing: fall back, loudly
            logger.warning("could not build the C++ %s (%s: %s); using the slower %s path",
                           what, type(e).__name__, e, fallback)
            return None
        stamp.write_text(key)
    return _join_pool(module)


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One build of an extension at a time, by a lock the OS releases when its holder dies.
    torch's own lock is a file that only its creator removes: a build killed mid-way (Ctrl-C
    on a first start, a timeout) left it behind, and every later start waited for it forever.
    Holding this lock, no other loom build is running, so such a file is stale and goes."""
    with open(directory / "loom-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)  # torch's FileBaton
        yield


_pool_owner: ModuleType | None = None  # the extension whose thread pool all of them use


def _join_pool(module: ModuleType) -> ModuleType:
    """Let the extension run its parallel work on the process's one pool of helper threads
    (csrc/parallel_dynamic.h says why one), made by the first extension loaded that has one."""
    global _pool_owner
    if not hasattr(module, "adopt_pool"):
        return module
    if _pool_owner is None:
        _pool_owner = module
    else:
        module.adopt_pool(_pool_owner.pool_address())
    return module


def _source_key(source: str, cflags: list[str] = _CFLAGS) -> str:
    """What a build depends on: the source, the headers beside it, the flags."""
    digest = hashlib.sha256(" ".join(cflags + _LDFLAGS).encode())
    for path in [_CSRC / source, *sorted(_CSRC.glob("*.h"))]:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _import_library(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
