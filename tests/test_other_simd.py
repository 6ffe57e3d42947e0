"""Kernel code for SIMD levels this host does not take, checked here too: the same source built
a second time (cached after the first run) and compared with the torch path.

- Attention: on an AVX-512 host the AVX2 kernel, which AVX2-only CPUs run (built with
  -mno-avx512f); on an AVX2 host the AVX-512 kernel, each AVX-512 intrinsic done as two AVX2
  halves (csrc/avx512_on_avx2.h): the same lanes and the same fused multiply-adds, so a fault
  in that kernel's tiling, blocking or tails shows here before an AVX-512 host runs it.
- The AMX bf16 matmul (fused_ops.cpp's amx_bf16_linear), on a host without AMX: its tiles in
  software (csrc/amx_on_avx2.h), so the kernel's panels, tile loop and stores are checked
  everywhere, not only where test_fused_ops.py runs it on real tiles."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
import torch
from test_attention import (
    DTYPES,
    WINDOW_CASES,
    assert_kernel_matches_torch,
    decode_both_ways,
    tiles_both_ways,
    variant_both_ways,
)
from test_fused_ops import check_amx_bf16_linear
from torch.utils.cpp_extension import load

from loom import host
from loom.model import kernels

pytestmark = pytest.mark.integration


def _build(name: str, source: str, flags: list[str]) -> ModuleType:
    """A second load() of one name in a process rebuilds it, hence one build per module. At
    -O1: these builds are checked, never timed, and a fresh checkout's test run compiles them
    (docs/benchmark-log.md has how much sooner than at -O3)."""
    return load(name=name, sources=[str(Path(kernels.__file__).parent / "csrc" / source)],
                build_directory=str(kernels._build_directory(name)),
                extra_cflags=[*kernels._CFLAGS, *flags, "-O1"], extra_ldflags=kernels._LDFLAGS)


def _attention_build() -> tuple[str, str, list[str]] | str:
    """The attention kernel of the SIMD level this host does not run, or why there is none."""
    level = host.simd_level()
    if level == "avx512":
        return "loom_paged_attention_avx2", "paged_attention.cpp", ["-mno-avx512f"]
    if level == "avx2":
        return ("loom_paged_attention_avx512_on_avx2", "paged_attention.cpp",
                ["-DLOOM_AVX512_ON_AVX2", "-Wno-psabi"])
    return f"no SIMD kernel to check on a {level} host but its own"


def _amx_build() -> tuple[str, str, list[str]] | str:
    """The AMX matmul on software tiles, or why it is not checked here."""
    own = kernels.fused_ops()
    if own is not None and own.amx_available():
        return "this host runs the AMX kernel on its tiles (test_fused_ops.py)"
    if host.simd_level() == "none":
        return "the software tiles need AVX2"
    return "loom_fused_ops_amx_on_avx2", "fused_ops.cpp", ["-DLOOM_AMX_ON_AVX2", "-Wno-psabi"]


@pytest.fixture(scope="module")
def builds() -> Iterator[dict[str, Future[ModuleType] | str]]:
    """Both builds started at once: each is one compiler process, so on a fresh checkout
    the second runs on a core the first leaves idle instead of after it."""
    with ThreadPoolExecutor(2) as pool:
        yield {name: how if isinstance(how, str) else pool.submit(_build, *how)
               for name, how in (("attention", _attention_build()), ("amx", _amx_build()))}


def _built(builds: dict[str, Future[ModuleType] | str], name: str) -> ModuleType:
    build = builds[name]
    if isinstance(build, str):
        pytest.skip(build)
    return build.result()


@pytest.fixture(scope="module")
def other_ops(builds: dict[str, Future[ModuleType] | str]) -> ModuleType:
    return _built(builds, "attention")


@pytest.fixture(scope="module")
def amx_on_avx2(builds: dict[str, Future[ModuleType] | str]) -> ModuleType:
    return _built(builds, "amx")


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 1, 64), (4, 4, 128)])
def test_other_simd_decode_kernel_matches_torch(other_ops: ModuleType, dtype, cache_dtype,
                                                tolerance, num_heads, num_kv_heads,
                                                head_dim) -> None:
    assert_kernel_matches_torch(decode_both_ways, other_ops, dtype, cache_dtype, tolerance,
                                (num_heads, num_kv_heads, head_dim))


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (6, 3, 64), (4, 4, 128)])
def test_other_simd_kernel_attends_tiles_each_row_over_its_own_context(
        other_ops: ModuleType, dtype, cache_dtype, tolerance, num_heads, num_kv_heads,
        head_dim) -> None:
    assert_kernel_matches_torch(tiles_both_ways, other_ops, dtype, cache_dtype, tolerance,
                                (num_heads, num_kv_heads, head_dim))


# windows at their edges on one thread; few long contexts on two, cut into spans
OTHER_SIMD_WINDOWS = [(*WINDOW_CASES[1], 1), (*WINDOW_CASES[2], 1),
                      (1000, [700, 1500, 2900], 2), (None, [700, 1500, 2900], 2)]


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
@pytest.mark.parametrize("window,lens,threads", OTHER_SIMD_WINDOWS)
@pytest.mark.parametrize("softcap,with_sinks", [(None, False), (5.0, True)])
def test_other_simd_kernel_attends_windows_softcap_and_sinks(
        other_ops: ModuleType, dtype, cache_dtype, tolerance, window, lens, threads, softcap,
        with_sinks) -> None:
    expected, actual = variant_both_ways(other_ops, dtype, cache_dtype, 9, 3, 64, window,
                                         softcap, with_sinks, lens, threads)
    assert torch.isfinite(actual.float()).all()
    torch.testing.assert_close(actual.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_amx_kernel_on_software_tiles_is_a_bf16_matmul(amx_on_avx2: ModuleType,
                                                            threads: int) -> None:
    assert amx_on_avx2.amx_available()
    check_amx_bf16_linear(amx_on_avx2, threads)
