"""The attention kernel of the SIMD level this host does not take, checked here too: the same
source built a second time (cached after the first run) and compared with the torch path. On an
AVX-512 host that is the AVX2 kernel, which AVX2-only CPUs run (built with -mno-avx512f). On an
AVX2 host it is the AVX-512 kernel, each AVX-512 intrinsic done as two AVX2 halves
(csrc/avx512_on_avx2.h): the same lanes and the same fused multiply-adds, so a fault in that
kernel's tiling, blocking or tails shows here before an AVX-512 host runs it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from test_attention import DTYPES, assert_kernel_matches_torch, decode_both_ways, tiles_both_ways
from torch.utils.cpp_extension import load

from loom import host
from loom.model import kernels

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def other_ops() -> ModuleType:
    """Built once per run: a second load() of one name rebuilds under a new one."""
    level = host.simd_level()
    if level == "avx512":
        name, flags = "loom_paged_attention_avx2", ["-mno-avx512f"]
    elif level == "avx2":
        name, flags = "loom_paged_attention_avx512_on_avx2", ["-DLOOM_AVX512_ON_AVX2",
                                                             "-Wno-psabi"]
    else:
        pytest.skip(f"no SIMD kernel to check on a {level} host but its own")
    return load(name=name,
                sources=[str(Path(kernels.__file__).parent / "csrc" / "paged_attention.cpp")],
                build_directory=str(kernels._build_directory(name)),
                extra_cflags=[*kernels._CFLAGS, *flags], extra_ldflags=kernels._LDFLAGS)


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
