"""loom.model.huge_pages: zeroed memory on huge-page boundaries, and many tensors cut from few
mappings (the native matmul's weight panels)."""

from __future__ import annotations

import pytest
import torch

from loom.model.huge_pages import HUGE_PAGE, Arena, thp_eligible, thp_enabled, zeroed

pytestmark = pytest.mark.unit


def test_zeroed_memory_starts_on_a_huge_page_and_is_zero_and_writable() -> None:
    t = zeroed(3 * HUGE_PAGE + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE + 5
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    t[-1] = 7
    assert int(t.sum()) == 7


def test_an_arena_cuts_aligned_disjoint_zero_tensors_from_few_mappings() -> None:
    arena = Arena(chunk_bytes=HUGE_PAGE)
    sizes = [100, 64, 1, 5000, 300_000, 3 * HUGE_PAGE, 17]  # one larger than a chunk
    tensors = [arena.take(n) for n in sizes]
    assert [t.numel() for t in tensors] == sizes
    assert all(t.data_ptr() % 64 == 0 and not t.any() for t in tensors)
    for i, t in enumerate(tensors):  # writing one leaves the others as they were
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate(tensors))
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    chunks = {t.data_ptr() // HUGE_PAGE for t in tensors[:4]}
    assert len(chunks) == 1  # the small ones share a mapping


def test_arena_memory_outlives_the_arena() -> None:
    tensor = Arena().take(1000)
    tensor.fill_(3)
    assert int(tensor.sum()) == 3000


def test_mappings_are_eligible_for_huge_pages_where_the_os_has_them() -> None:
    if not thp_enabled():
        pytest.skip("no transparent huge pages on this host")
    assert thp_eligible(zeroed(HUGE_PAGE)) is True
    assert thp_eligible(Arena().take(4096)) is True
