"""The native paged decode-attention kernel against the torch gather + SDPA path, on random
caches with scattered block tables, ragged context lengths and grouped-query heads."""

from __future__ import annotations

import random

import pytest
import torch

from loom.model.attention import AttentionMetadata, new_kv_cache, paged_attention
from loom.model.kernels import paged_attention_ops
from loom.model.runner import ModelRunner

pytestmark = pytest.mark.unit


def decode_metadata(tables: list[list[int]], lens: list[int], block_size: int,
                    native: bool) -> AttentionMetadata:
    runner = ModelRunner.__new__(ModelRunner)  # only the metadata builders are needed
    runner.block_size, runner.device = block_size, torch.device("cpu")
    slots = (torch.zeros(0, dtype=torch.long),) * 2  # decodes only: nothing is written
    if native:
        return AttentionMetadata(slots, [], [], runner._paged_decodes(tables, lens))
    return AttentionMetadata(slots, runner._decode_groups(tables, lens), [])


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
def test_native_decode_attention_matches_torch(dtype, tolerance, num_heads, num_kv_heads,
                                               head_dim) -> None:
    ops = paged_attention_ops()
    assert ops is not None, "the kernel must build on the test machine"
    assert ops.supported(num_heads, num_kv_heads, head_dim, 16, dtype)
    rng = random.Random(0)
    torch.manual_seed(0)
    block_size, num_blocks = 16, 400
    k_cache, v_cache = new_kv_cache(num_blocks + 1, block_size, num_kv_heads, head_dim, dtype,
                                    torch.device("cpu"))
    k_cache.copy_(torch.randn(k_cache.shape))
    v_cache.copy_(torch.randn(v_cache.shape))
    lens = sorted(rng.randint(1, 600) for _ in range(12))
    free = rng.sample(range(num_blocks), num_blocks)
    tables = []
    for length in lens:
        count = -(-length // block_size)
        tables.append(free[:count])
        free = free[count:]
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    k_new = torch.zeros(len(lens), num_kv_heads, head_dim, dtype=dtype)  # unused by decodes
    expected, actual = (
        paged_attention(q, k_new, k_new, k_cache, v_cache,
                        decode_metadata(tables, lens, block_size, native))
        for native in (False, True))
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_shapes_outside_the_kernel_are_reported_unsupported() -> None:
    ops = paged_attention_ops()
    assert not ops.supported(4, 4, 32, 16, torch.float32)  # head_dim
    assert not ops.supported(9, 3, 64, 8, torch.float32)  # block size
    assert not ops.supported(9, 3, 64, 16, torch.float16)
    assert not ops.supported(36, 3, 64, 16, torch.float32)  # 12 heads per kv head


def test_each_environment_and_checkout_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two virtualenvs, or two checkouts run from one (an A/B from a git worktree), must not
    share a build folder: each would rebuild the other's kernel on every start."""
    from loom.model import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = kernels._build_directory("k")
    assert here == kernels._build_directory("k") and here.is_dir()
    assert here.parent.parent == tmp_path
    monkeypatch.setattr(kernels, "_CSRC", tmp_path / "other-checkout" / "csrc")
    other_checkout = kernels._build_directory("k")
    monkeypatch.setattr(kernels.sys, "prefix", str(tmp_path / "other-venv"))
    other_venv = kernels._build_directory("k")
    assert len({here, other_checkout, other_venv}) == 3
