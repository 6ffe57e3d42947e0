"""Block pool and KV cache manager: reference counts, free list order, prefix cache."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.core.block_pool import BlockPool
from loom.core.kv_cache import KVCacheManager
from loom.request import Request
from loom.sampling import SamplingParams

pytestmark = pytest.mark.unit


def test_allocate_free_and_double_free() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="only 1 free"):
        pool.allocate(2)
    pool.free(ids)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([ids[0]])


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block_id, block_hash in ((a, 11), (b, 22), (c, 33)):
        pool.cache(block_id, block_hash)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.lookup(22) == b  # still cached while free
    (first,) = pool.allocate(1)
    assert first == b and pool.lookup(22) is None  # evicted LRU, its hash forgotten
    assert pool.lookup(11) == a and pool.lookup(33) == c


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, 7)
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([pool.lookup(7)])
    assert pool.num_free_blocks == 1 and pool.ref_cnt[a] == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]),
                          st.integers(0, 6)), max_size=60))
def test_pool_invariants_under_random_operations(ops: list[tuple[str, int]]) -> None:
    """Every block is free xor referenced; ref counts match the holders; cached map agrees."""
    pool = BlockPool(8)
    held: list[int] = []  # one entry per reference we hold
    for op, arg in ops:
        if op == "alloc" and arg <= pool.num_free_blocks:
            held += pool.allocate(arg)
        elif op == "free" and held:
            pool.free([held.pop(arg % len(held))])
        elif op == "cache" and held:
            pool.cache(held[arg % len(held)], hash(("h", arg)))
        elif op == "touch" and pool.cached_block_id:
            block_id = sorted(pool.cached_block_id.values())[arg % len(pool.cached_block_id)]
            pool.touch([block_id])
            held.append(block_id)
        for block_id in range(pool.num_blocks):
            assert pool.ref_cnt[block_id] == held.count(block_id)
            assert (block_id in pool.free_block_ids) == (pool.ref_cnt[block_id] == 0)
        for block_hash, block_id in pool.cached_block_id.items():
            assert pool.block_hash[block_id] == block_hash
    pool.free(held)
    assert pool.num_free_blocks == pool.num_blocks


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def _compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Allocate and 'run' num_tokens, then publish the blocks they filled."""
    assert kv.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)


def test_prefix_is_shared_only_for_full_identical_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = _request("a", list(range(10)))
    assert kv.find_cached_prefix(first) == []
    assert kv.allocate_slots(first, 10)
    assert kv.find_cached_prefix(_request("x", list(range(10)))) == []  # not published yet
    first.num_computed_tokens = 10
    kv.cache_blocks(first, first.num_computed_tokens)
    # 10 tokens = 2 full blocks + 2 tokens; the full ones are published
    same_prefix = _request("b", list(range(8)) + [99, 98, 97])
    hit = kv.find_cached_prefix(same_prefix)
    assert hit == kv.get_block_table("a")[:2]
    other = _request("c", [0, 1, 2, 5] + list(range(4, 11)))
    assert kv.find_cached_prefix(other) == []  # first block differs, so nothing after counts


def test_last_token_is_never_served_from_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    _compute(kv, _request("a", list(range(8))), 8)
    again = _request("b", list(range(8)))
    assert len(kv.find_cached_prefix(again)) == 1  # 8 tokens: only the first block, not both


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    request = _request("a", list(range(12)))
    assert not kv.allocate_slots(request, 12)
    assert kv.pool.num_free_blocks == 2 and kv.get_block_table("a") == []


def test_withdrawn_blocks_are_no_longer_found_but_computed_ones_stay() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = _request("a", list(range(13)))
    assert kv.allocate_slots(first, 13)
    kv.cache_blocks(first, 13)  # published while scheduled; only 4 tokens are computed
    first.num_computed_tokens = 4
    assert len(kv.find_cached_prefix(_request("b", list(range(13))))) == 3
    assert kv.withdraw_uncomputed_blocks(first) == kv.get_block_table("a")[1:3]
    assert kv.find_cached_prefix(_request("c", list(range(13)))) == kv.get_block_table("a")[:1]
    kv.free(first)
    assert kv.pool.num_free_blocks == 8


class _EagerPool:
    """The pool before its free list was lazy (every id queued up front): the oracle."""

    def __init__(self, num_blocks: int) -> None:
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_id: dict[int, int] = {}

    def allocate(self, n: int) -> list[int]:
        block_ids = [self.free_block_ids.popitem(last=False)[0] for _ in range(n)]
        for block_id in block_ids:
            self.evict(block_id)
            self.ref_cnt[block_id] = 1
        return block_ids

    def touch(self, block_id: int) -> None:
        if self.ref_cnt[block_id] == 0:
            del self.free_block_ids[block_id]
        self.ref_cnt[block_id] += 1

    def free(self, block_id: int) -> None:
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 0:
            self.free_block_ids[block_id] = None

    def cache(self, block_id: int, block_hash: int) -> None:
        if self.block_hash[block_id] is None and block_hash not in self.cached_block_id:
            self.block_hash[block_id] = block_hash
            self.cached_block_id[block_hash] = block_id

    def evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            if self.cached_block_id.get(block_hash) == block_id:
                del self.cached_block_id[block_hash]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch", "evict",
                                           "reset"]), st.integers(0, 9)), max_size=80))
def test_lazy_free_list_hands_out_what_an_eager_one_did(ops: list[tuple[str, int]]) -> None:
    """Same blocks handed out, same eviction order, counts and cache map, step by step."""
    pool, eager = BlockPool(10), _EagerPool(10)
    held: list[int] = []
    for op, arg in ops:
        if op == "alloc" and arg <= pool.num_free_blocks:
            ids = pool.allocate(arg)
            assert ids == eager.allocate(arg)
            held += ids
        elif op == "free" and held:
            block_id = held.pop(arg % len(held))
            pool.free([block_id])
            eager.free(block_id)
        elif op == "cache" and held:
            pool.cache(held[arg % len(held)], arg % 4)  # few hashes: first writer wins
            eager.cache(held[arg % len(held)], arg % 4)
        elif op == "touch" and pool.cached_block_id:
            block_id = sorted(pool.cached_block_id.values())[arg % len(pool.cached_block_id)]
            pool.touch([block_id])
            eager.touch(block_id)
            held.append(block_id)
        elif op == "evict":
            pool.evict(arg)
            eager.evict(arg)
        elif op == "reset":
            pool.reset_prefix_cache()
            for block_id in range(10):
                eager.evict(block_id)
        assert list(pool.free_block_ids) == list(eager.free_block_ids)
        assert pool.num_free_blocks == len(eager.free_block_ids)
        assert pool.ref_cnt == eager.ref_cnt and pool.block_hash == eager.block_hash
        assert pool.cached_block_id == eager.cached_block_id


def test_a_large_pool_costs_no_free_list_entries_until_blocks_are_freed() -> None:
    pool = BlockPool(100_000)
    assert pool.num_free_blocks == 100_000 and 99_999 in pool.free_block_ids
    ids = pool.allocate(3)
    assert ids == [0, 1, 2] and 0 not in pool.free_block_ids
    assert len(pool.free_block_ids.freed) == 0
    pool.free([ids[1]])
    assert list(pool.free_block_ids)[-1] == 1 and len(pool.free_block_ids.freed) == 1
    with pytest.raises(RuntimeError, match="not a freed block"):
        pool.touch([50])  # never used, so never cached: no prefix hit can name it
