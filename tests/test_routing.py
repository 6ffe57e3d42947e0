"""The routing policy (loom.cluster.routing): pure code shared by Ray Serve and the simulator."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.cluster.routing import (
    ROUTERS,
    UNAVAILABLE,
    PrefixAffinity,
    make_policy,
    prompt_block_hashes,
)
from loom.core.kv_cache import KVCacheManager
from loom.request import Request
from loom.sampling import SamplingParams

pytestmark = pytest.mark.unit

queues = st.lists(st.integers(0, 50), min_size=1, max_size=8)


def test_block_hashes_are_the_prefix_caches() -> None:
    """The router names blocks exactly as the KV cache manager does: full blocks only."""
    tokens = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens
    request = Request("r", tokens, SamplingParams(max_tokens=1))
    manager = KVCacheManager(num_blocks=8, block_size=16, enable_prefix_caching=True)
    assert prompt_block_hashes(tokens, 16) == manager._full_block_hashes(request, 3)
    assert prompt_block_hashes(tokens[:15], 16) == []


def test_block_hashes_are_chained() -> None:
    a = prompt_block_hashes([1] * 16 + [2] * 16, 16)
    b = prompt_block_hashes([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same second block, different history
    assert prompt_block_hashes([1] * 16 + [2] * 16 + [9] * 16, 16)[:2] == a


@pytest.mark.parametrize("name", ROUTERS)
@given(queue_lengths=queues, hashes=st.lists(st.integers(), max_size=4))
@settings(max_examples=50, deadline=None)
def test_choice_is_a_replica(name: str, queue_lengths: list[int], hashes: list[int]) -> None:
    policy = make_policy(name, len(queue_lengths), seed=1)
    for _ in range(3):
        replica = policy.choose(hashes, queue_lengths)
        assert 0 <= replica < len(queue_lengths)
        policy.record(replica, hashes)


@pytest.mark.parametrize("name", ROUTERS)
@given(queue_lengths=st.lists(st.integers(0, 50), min_size=2, max_size=8),
       down=st.data())
@settings(max_examples=50, deadline=None)
def test_unavailable_replicas_are_skipped(name: str, queue_lengths: list[int],
                                          down: st.DataObject) -> None:
    dead = down.draw(st.sets(st.integers(0, len(queue_lengths) - 1),
                             max_size=len(queue_lengths) - 1))
    lengths = [UNAVAILABLE if i in dead else q for i, q in enumerate(queue_lengths)]
    policy = make_policy(name, len(lengths), seed=2)
    hashes = [7, 8]
    for replica in dead:  # even the replica that holds the prefix is skipped while down
        policy.record(replica, hashes)
    for _ in range(5):
        assert policy.choose(hashes, lengths) not in dead


def test_round_robin_cycles() -> None:
    policy = make_policy("round-robin", 3)
    assert [policy.choose([], [0, 0, 0]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


@given(queue_lengths=st.lists(st.integers(0, 50), min_size=2, max_size=8))
@settings(max_examples=50, deadline=None)
def test_pow2_never_picks_the_longest_queue_when_it_is_unique(queue_lengths: list[int]) -> None:
    policy = make_policy("pow2", len(queue_lengths), seed=3)
    longest = max(queue_lengths)
    if queue_lengths.count(longest) == 1:
        for _ in range(10):
            assert queue_lengths[policy.choose([], queue_lengths)] < longest


def test_pow2_is_deterministic_for_a_seed() -> None:
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    a, b = make_policy("pow2", 8, seed=5), make_policy("pow2", 8, seed=5)
    assert [a.choose([], lengths) for _ in range(20)] == [b.choose([], lengths) for _ in range(20)]


def test_prefix_follows_the_longest_match() -> None:
    policy = make_policy("prefix", 3)
    doc = prompt_block_hashes(list(range(64)), 16)
    longer = prompt_block_hashes(list(range(96)), 16)
    policy.record(1, doc[:2])
    policy.record(2, longer)  # replica 2 holds the whole of the longer prompt
    assert policy.choose(doc[:2] + [12345], [0, 0, 0]) == 2  # most recent owner of block 2
    policy.record(0, doc[:1])
    assert policy.choose(doc, [0, 0, 0]) == 2  # 2 holds 4 blocks, 0 only one
    assert policy.choose(doc[:1], [0, 0, 0]) == 0  # the most recent owner of that block


@given(queue_lengths=st.lists(st.integers(0, 40), min_size=2, max_size=6),
       threshold=st.integers(0, 10))
@settings(max_examples=100, deadline=None)
def test_prefix_sticks_unless_imbalanced(queue_lengths: list[int], threshold: int) -> None:
    policy = make_policy("prefix", len(queue_lengths), imbalance_threshold=threshold)
    policy.record(0, [11, 22])
    chosen = policy.choose([11, 22, 33], queue_lengths)
    if queue_lengths[0] - min(queue_lengths) <= threshold:
        assert chosen == 0 and policy.last_decision == "prefix"
    else:
        assert policy.last_decision == "imbalanced"  # and the same draw as pow2's
        assert chosen == make_policy("pow2", len(queue_lengths)).choose([], queue_lengths)


def test_prefix_memory_is_bounded_lru() -> None:
    policy = make_policy("prefix", 2, max_tracked_blocks=3)
    assert isinstance(policy, PrefixAffinity)
    policy.record(0, [1, 2, 3])
    policy.record(1, [4])
    assert policy.num_tracked_blocks == 3
    assert policy.matching_replica([1]) is None  # the least recently recorded went first
    assert policy.matching_replica([2, 3]) == (0, 2)
    policy.forget(0)
    assert policy.matching_replica([2, 3]) is None
    assert policy.matching_replica([4]) == (1, 1)


def test_prefix_spreads_documents_and_keeps_each_on_one_replica() -> None:
    """A RAG-like trace: each document's requests land on one replica, the documents spread."""
    policy = make_policy("prefix", 2, seed=0)
    docs = [prompt_block_hashes([d * 1000 + t for t in range(256)], 16) for d in range(4)]
    placed: dict[int, Counter[int]] = {d: Counter() for d in range(4)}
    load = [0, 0]
    for i in range(80):
        doc = i % 4
        question = [hash(("q", i))]
        hashes = docs[doc] + question
        replica = policy.choose(hashes, load)
        policy.record(replica, hashes)
        placed[doc][replica] += 1
        load[replica] += 1
        load[1 - replica] = max(0, load[1 - replica] - 1)
    for counts in placed.values():
        assert max(counts.values()) >= 0.9 * sum(counts.values())


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "random", "num_replicas": 2}, "unknown router"),
    ({"name": "prefix", "num_replicas": 0}, "num_replicas"),
    ({"name": "prefix", "num_replicas": 2, "imbalance_threshold": -1}, "imbalance_threshold"),
    ({"name": "prefix", "num_replicas": 2, "max_tracked_blocks": 0}, "max_tracked_blocks"),
])
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy(**kwargs)
