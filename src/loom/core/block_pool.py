"""A fixed pool of KV cache blocks: free list, reference counts and the prefix-cache map.

A block is in exactly one of three states: used (ref_cnt > 0), free and cached (ref_cnt == 0,
holds a hash, can be revived by a prefix hit until it is evicted), or free and empty. Free
blocks sit in `free_block_ids` in eviction order, least recently freed first, so cached
blocks survive as long as possible and are evicted LRU only when a block is needed.

The free list is filled lazily: blocks never handed out are the ids from `num_fresh_used` up,
ahead of every freed block in eviction order (they were there first and nothing moves them:
only cached blocks are revived, and a never-used block holds no hash). So they are a counter,
not entries: a pool costs its two per-block lists plus one entry per block freed so far,
which is what lets a simulated fleet of a thousand replicas, each with an H100's cache of
tens of thousands of blocks, fit in memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator


class FreeBlocks:
    """The free list in eviction order: never-used ids ascending, then freed ones LRU."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_fresh_used = 0  # ids below this have been handed out at least once
        self.freed: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return self.num_blocks - self.num_fresh_used + len(self.freed)

    def __contains__(self, block_id: int) -> bool:
        return block_id >= self.num_fresh_used or block_id in self.freed

    def __iter__(self) -> Iterator[int]:
        yield from range(self.num_fresh_used, self.num_blocks)
        yield from self.freed

    def pop_first(self) -> int:
        if self.num_fresh_used < self.num_blocks:
            self.num_fresh_used += 1
            return self.num_fresh_used - 1
        return self.freed.popitem(last=False)[0]

    def remove(self, block_id: int) -> None:
        """Take a freed block out of the list (a prefix hit revives it; only a block handed
        out before can hold a hash, so a never-used one is a caller's bug)."""
        if block_id not in self.freed:
            raise RuntimeError(f"KV block {block_id} is not a freed block to revive")
        del self.freed[block_id]

    def append(self, block_id: int) -> None:
        self.freed[block_id] = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_block_ids = FreeBlocks(num_blocks)
        self.cached_block_id: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live request (cached-but-free blocks count free)."""
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the free list, evicting their cached contents."""
        if n > len(self.free_block_ids):
            raise ValueError(f"asked for {n} blocks, only {len(self.free_block_ids)} free")
        block_ids = []
        for _ in range(n):
            block_id = self.free_block_ids.pop_first()
            self.evict(block_id)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take another reference on blocks found in the prefix cache."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                self.free_block_ids.remove(block_id)
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the free list."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_block_ids.append(block_id)

    def lookup(self, block_hash: int) -> int | None:
        return self.cached_block_id.get(block_hash)

    def cache(self, block_id: int, block_hash: int) -> None:
        """Publish a full block under its chained hash (first writer wins)."""
        if self.block_hash[block_id] is None and block_hash not in self.cached_block_id:
            self.block_hash[block_id] = block_hash
            self.cached_block_id[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.cached_block_id.values()):
            self.evict(block_id)

    def evict(self, block_id: int) -> None:
        """Stop serving the block from the prefix cache (reused, or its contents are void)."""
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            if self.cached_block_id.get(block_hash) == block_id:
                del self.cached_block_id[block_hash]
