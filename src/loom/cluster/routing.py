"""Which replica serves a request: the routing policy, as pure code.

One policy, two drivers: the Ray Serve request router (`loom.cluster.ray_router`) and the
fleet simulator (`loom simulate --replicas N --router ...`) call the same `choose` / `record`,
so what the simulator predicts is what the cluster does. Nothing here imports ray or torch.

A policy sees replicas as indices 0..N-1 and, per request, the chained hashes of the prompt's
full KV blocks (the prefix cache's own names for them) and each replica's queue length
(requests queued + running). A replica that cannot take requests now has queue length
`UNAVAILABLE`; every policy skips it while another one is available.
"""

from __future__ import annotations

import random
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from loom.core.kv_cache import hash_block

ROUTERS = ("prefix", "pow2", "round-robin")
# What a choice was based on: the prefix a replica holds, a prefix given up for a shorter
# queue, no known prefix, or a policy that never looks at prefixes.
DECISIONS = ("prefix", "imbalanced", "no-match", "pow2", "round-robin")
UNAVAILABLE = sys.maxsize  # queue length of a replica that cannot take requests now

# A replica's queue may exceed the least-loaded one's by this many requests before the prefix
# policy gives up its cached prefix for the shorter queue: recomputing a shared prefix costs
# a whole prefill, a few extra requests in the batch cost a little inter-token latency each.
DEFAULT_IMBALANCE_THRESHOLD = 8
# Block hashes remembered by the prefix policy (the least recently used are forgotten first);
# enough for every block of a few large KV caches, a few MB of memory.
DEFAULT_MAX_TRACKED_BLOCKS = 1 << 16


class RoutingPolicy(Protocol):
    def choose(self, block_hashes: Sequence[int], queue_lengths: Sequence[int]) -> int:
        """The index of the replica to serve a request whose prompt has these block hashes."""
        ...

    def record(self, replica: int, block_hashes: Sequence[int]) -> None:
        """The replica was chosen for these blocks and now holds them."""
        ...

    @property
    def last_decision(self) -> str:
        """Why the last `choose` chose as it did (one of DECISIONS), for the router's metrics."""
        ...


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, as the prefix cache names them.

    Python's `hash` of a tuple holding None is only stable within one process, so the hashes
    are compared only where they were computed: in the router's own process.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


def _available(queue_lengths: Sequence[int]) -> list[int]:
    """Indices of the replicas that can take a request (all of them if none can: the caller
    then gets an error from the replica instead of a request that waits forever here)."""
    live = [i for i, q in enumerate(queue_lengths) if q < UNAVAILABLE]
    return live or list(range(len(queue_lengths)))


class RoundRobin:
    """Each available replica in turn, whatever the prompt: the baseline."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.last_decision = "round-robin"
        self._next = 0

    def choose(self, block_hashes: Sequence[int], queue_lengths: Sequence[int]) -> int:
        live = set(_available(queue_lengths))
        for step in range(len(queue_lengths)):
            candidate = (self._next + step) % len(queue_lengths)
            if candidate in live:
                self._next = candidate + 1
                return candidate
        raise AssertionError("unreachable: _available is never empty")

    def record(self, replica: int, block_hashes: Sequence[int]) -> None:
        pass


class PowerOfTwo:
    """Two available replicas drawn at random, the shorter queue wins (Mitzenmacher's power of
    two choices: near-least-loaded without a global minimum each time). Seeded, so a simulation
    replays the same decisions."""

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        self.num_replicas = num_replicas
        self.last_decision = "pow2"
        self._rng = random.Random(seed)

    def choose(self, block_hashes: Sequence[int], queue_lengths: Sequence[int]) -> int:
        live = _available(queue_lengths)
        if len(live) == 1:
            return live[0]
        first, second = self._rng.sample(live, 2)
        return second if queue_lengths[second] < queue_lengths[first] else first

    def record(self, replica: int, block_hashes: Sequence[int]) -> None:
        pass


class PrefixAffinity:
    """The replica that most recently served the longest matching prefix of the prompt, unless
    its queue exceeds the least-loaded replica's by more than `imbalance_threshold`; then, or
    when no prefix matches, power of two choices on queue length.

    Memory is bounded: an LRU of block hash -> the replica that last recorded it. Because the
    hashes are chained, a match on a prompt's k-th block means its first k blocks all match.
    """

    def __init__(self, num_replicas: int, *, seed: int = 0,
                 imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                 max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS) -> None:
        self.num_replicas = num_replicas
        self.imbalance_threshold = imbalance_threshold
        self.max_tracked_blocks = max_tracked_blocks
        self.last_decision = "no-match"
        self._owner: OrderedDict[int, int] = OrderedDict()
        self._fallback = PowerOfTwo(num_replicas, seed)

    def matching_replica(self, block_hashes: Sequence[int]) -> tuple[int, int] | None:
        """(replica, matched blocks) for the longest prefix a replica is known to hold."""
        for length in range(len(block_hashes), 0, -1):
            owner = self._owner.get(block_hashes[length - 1])
            if owner is not None:
                return owner, length
        return None

    def choose(self, block_hashes: Sequence[int], queue_lengths: Sequence[int]) -> int:
        match = self.matching_replica(block_hashes)
        self.last_decision = "no-match"
        if match is not None:
            replica = match[0]
            least = min(queue_lengths[i] for i in _available(queue_lengths))
            if queue_lengths[replica] - least <= self.imbalance_threshold:
                self.last_decision = "prefix"
                return replica
            self.last_decision = "imbalanced"
        return self._fallback.choose(block_hashes, queue_lengths)

    def record(self, replica: int, block_hashes: Sequence[int]) -> None:
        for block_hash in block_hashes:
            self._owner[block_hash] = replica
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self.max_tracked_blocks:
            self._owner.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica lost its cache (it was restarted): no prefix is routed to it any more."""
        for block_hash in [h for h, owner in self._owner.items() if owner == replica]:
            del self._owner[block_hash]

    @property
    def num_tracked_blocks(self) -> int:
        return len(self._owner)


def make_policy(name: str, num_replicas: int, *, seed: int = 0,
                imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS) -> RoutingPolicy:
    """The policy called `name` (one of ROUTERS) over `num_replicas` replicas."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if imbalance_threshold < 0:
        raise ValueError(f"imbalance_threshold must be >= 0, got {imbalance_threshold}")
    if max_tracked_blocks < 1:
        raise ValueError(f"max_tracked_blocks must be >= 1, got {max_tracked_blocks}")
    if name == "prefix":
        return PrefixAffinity(num_replicas, seed=seed, imbalance_threshold=imbalance_threshold,
                              max_tracked_blocks=max_tracked_blocks)
    if name == "pow2":
        return PowerOfTwo(num_replicas, seed)
    if name == "round-robin":
        return RoundRobin(num_replicas)
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
