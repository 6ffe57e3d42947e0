"""The AVX2 decode-attention kernel, which AVX2-only CPUs run, checked on a host whose own build
takes the AVX-512 one: the same source compiled without AVX-512 (a second build, cached after
the first run), against the torch path."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from test_attention import DTYPES, decode_both_ways
from torch.utils.cpp_extension import load

from loom import host
from loom.model import kernels

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def avx2_ops() -> ModuleType:
    """Built once per run: a second load() of one name rebuilds under a new one."""
    if host.simd_level() != "avx512":
        pytest.skip("the host's own build is the AVX2 one (test_attention.py checks it)")
    return load(name="loom_paged_attention_avx2",
                sources=[str(Path(kernels.__file__).parent / "csrc" / "paged_attention.cpp")],
                build_directory=str(kernels._build_directory("loom_paged_attention_avx2")),
                extra_cflags=[*kernels._CFLAGS, "-mno-avx512f"], extra_ldflags=kernels._LDFLAGS)


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 1, 64)])
def test_avx2_decode_kernel_matches_torch(avx2_ops: ModuleType, dtype, cache_dtype, tolerance,
                                          num_heads, num_kv_heads, head_dim) -> None:
    expected, actual = decode_both_ways(avx2_ops, dtype, cache_dtype, num_heads, num_kv_heads,
                                        head_dim)
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)
