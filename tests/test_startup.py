"""Start-up: a kernel already built for this source is imported straight from its library,
without torch's build tools (importing them and asking ninja took longer than making the
model); a changed source still goes through the build."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from loom.model import kernels

needs_kernels = pytest.mark.skipif(kernels.paged_attention_ops() is None,
                                   reason="no C++ compiler")


def _fresh_python(code: str) -> str:
    """What `code` prints in a fresh interpreter (nothing loaded yet)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


@needs_kernels
@pytest.mark.integration
def test_built_kernels_load_without_the_build_tools() -> None:
    # built here first: a source changed since the last build (a merge, an edit) is built by
    # whichever process loads it first, and that must not be the one under test
    assert None not in (kernels.paged_attention_ops(), kernels.block_quant_linear_ops(),
                        kernels.fused_ops(), kernels.gguf_blocks_ops())
    assert _fresh_python(
        "import sys; from loom.model import kernels; "
        "assert None not in (kernels.paged_attention_ops(), kernels.block_quant_linear_ops(), "
        "kernels.fused_ops(), kernels.gguf_blocks_ops()); "
        "print('torch.utils.cpp_extension' in sys.modules)") == "False"


@needs_kernels
@pytest.mark.unit
@pytest.mark.parametrize("first", ["paged_attention_ops", "block_quant_linear_ops"])
def test_the_extensions_share_one_thread_pool(first: str) -> None:
    """Both extensions with parallel loops run them on one pool of helpers, whichever is
    loaded first (csrc/parallel_dynamic.h: separate pools took turns on the cores)."""
    second = ({"paged_attention_ops", "block_quant_linear_ops"} - {first}).pop()
    assert _fresh_python(
        f"from loom.model import kernels; a = kernels.{first}(); b = kernels.{second}(); "
        "print(a.pool_address() == b.pool_address() != 0)") == "True"


@needs_kernels
@pytest.mark.unit
def test_a_stale_stamp_goes_through_the_build(tmp_path: Path, monkeypatch) -> None:
    """A library whose stamp names other sources (or flags) is not imported; torch's build
    is asked (it rebuilds what changed) and the stamp is renewed; a matching stamp skips it."""
    import torch.utils.cpp_extension

    name = "loom_fused_ops"
    built = kernels._build_directory(name) / f"{name}.so"
    shutil.copy(built, tmp_path / built.name)
    stamp = tmp_path / f"{name}.loom-stamp"
    stamp.write_text("sources of another checkout")
    monkeypatch.setattr(kernels, "_build_directory", lambda _: tmp_path)
    builds: list[str] = []

    def build(**kwargs: object) -> ModuleType:
        builds.append(str(kwargs["name"]))
        return kernels._import_library(name, tmp_path / built.name)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    module = kernels._build(name, "fused_ops.cpp", "fused norm kernel", "torch")
    assert builds == [name] and hasattr(module, "add_rms_norm")
    assert stamp.read_text() == kernels._source_key("fused_ops.cpp")
    again = kernels._build(name, "fused_ops.cpp", "fused norm kernel", "torch")
    assert builds == [name] and hasattr(again, "silu_mul")


@pytest.mark.unit
def test_a_build_killed_midway_leaves_no_lock_that_blocks_the_next(tmp_path: Path) -> None:
    """torch's build lock is a file only its creator removes: a build killed mid-way left it,
    and every later start waited on it forever. loom's own lock dies with its holder (the OS
    releases a flock), and whoever takes it removes torch's leftover file; while a live build
    holds it, another waits (here: fails to take it without blocking)."""
    import fcntl

    killed = subprocess.run([sys.executable, "-c", (
        "import os, sys; from pathlib import Path; from loom.model import kernels\n"
        f"d = Path({str(tmp_path)!r})\n"
        "with kernels._build_lock(d):\n"
        "    (d / 'lock').write_text('')\n"  # torch's baton, as a build makes it
        "    os._exit(9)")], check=False)
    assert killed.returncode == 9 and (tmp_path / "lock").exists()
    with kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "loom-build.lock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.unit
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_memory_loading_freed_goes_back_to_the_os() -> None:
    """Large arrays freed between live small ones stay resident in glibc's heap (as the
    loader's copies did, between what the model keeps) until the runner hands them back. In
    a fresh interpreter: a 24 MiB array freed first raises glibc's mmap threshold above the
    16 MiB ones, so those come from the heap."""
    freed_kib = _fresh_python(
        "import numpy as np\n"
        "from loom.model.runner import _return_freed_heap\n"
        "def rss(): return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])\n"
        "first = np.ones(24 << 20, np.uint8); del first\n"
        "arrays, kept = [], []\n"
        "for _ in range(16):\n"
        "    arrays.append(np.ones(16 << 20, np.uint8)); kept.append(np.ones(1 << 16, np.uint8))\n"
        "del arrays\n"
        "before = rss(); _return_freed_heap(); print(before - rss())")
    assert int(freed_kib) > 128 << 10
