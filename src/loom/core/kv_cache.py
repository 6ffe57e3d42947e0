"""Per-request block tables over the block pool, and prefix-cache lookup.

Full blocks are named by a hash chained over (parent hash, token ids of the block), so two
requests share a block only if every token before and inside it is the same.

A model with sliding-window layers may keep their K/V in a KV group of its own
(`SlidingKVGroup`): its own pool and, per request, a second block table as long as the first,
in which the blocks that slid out of the window are freed at once (allocate_slots' picture).
The scheduler admits against the full layers' pool only; the sliding pool is sized so that it
does not run out (`SlidingKVGroup.blocks_needed`), and if it ever did, allocate_slots fails
as for the full pool and the scheduler preempts. Prefix hits cover both groups: a prefix is
served only as far as the sliding pool still holds, under the same chained hashes, the blocks
the window reaches back to from the hit's end (`_sliding_hit`).
"""

from __future__ import annotations

from loom.core.batch import SlidingKVGroup
from loom.core.block_pool import BlockPool
from loom.request import Request


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 sliding: SlidingKVGroup | None = None) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[int]] = {}
        self.num_published_blocks: dict[str, int] = {}
        # the sliding layers' KV group: its pool, and per request its table (null_block where
        # a block slid out of the window) with how many leading entries are null
        self.sliding = sliding
        self.sliding_pool = BlockPool(sliding.num_blocks) if sliding is not None else None
        self.sliding_tables: dict[str, list[int]] = {}
        self.num_slid_out: dict[str, int] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def get_sliding_block_table(self, request_id: str) -> list[int]:
        """The request's table in the sliding group (empty without one)."""
        return self.sliding_tables.get(request_id, [])

    def first_window_block(self, position: int) -> int:
        """The first block a query at `position` attends to in a sliding layer: the one
        holding position - W + 1 (0 without a sliding group)."""
        if self.sliding is None:
            return 0
        return max(0, position - self.sliding.window + 1) // self.block_size

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached run of full blocks at the start of the request.

        The last token is never taken from the cache: the model must run on at least one token
        to produce the logits the next token is sampled from. Requests that want prompt
        logprobs skip the cache: cached positions would have no logits to score them with.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        num_full_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._full_block_hashes(request, num_full_blocks)
        found = []
        for block_hash in hashes[:num_full_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        if self.sliding_pool is not None:
            found = found[:self._sliding_hit(hashes, len(found))]
        return found

    def _sliding_hit(self, hashes: list[int], num_found: int) -> int:
        """The longest hit of at most num_found blocks whose window is all in the sliding
        pool: with h blocks found, the first query (at h * block_size) reads the sliding
        blocks first_window_block(h * block_size) .. h - 1. block_size 4, W = 6:

            hashes         h0   h1   h2   h3   h4        (full pool: all five found)
            sliding pool   h0   h1   --   h3   --        (h2 and h4 were evicted)
            h = 5: the query at 20 reads 15 .. : blocks 3, 4 -> h4 missing
            h = 4: 16 reads 11 .. : blocks 2, 3 -> h2 missing;  h = 3: 12 reads 7 .. : 1, 2
            h = 2: 8 reads 3 .. : blocks 0, 1 -> both there: a hit of 2 blocks
        """
        best, run = 0, 0  # run: sliding blocks found in a row, ending at block i
        for i in range(num_found):
            run = run + 1 if self.sliding_pool.lookup(hashes[i]) is not None else 0
            if run >= i + 1 - self.first_window_block((i + 1) * self.block_size):
                best = i + 1
        return best

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_block_ids: list[int] | None = None) -> bool:
        r"""Make room for `num_new_tokens` more tokens (after any cached prefix); False if the
        pool cannot, in which case nothing changes.

        The table covers every token scheduled so far, whole blocks only; blocks are added
        just when the step's tokens spill past the last one. block_size = 4:

          admission of the prompt "abcdefghij" (10 tokens) with 2 blocks found in the
          prefix cache, so num_new_tokens = 2:

            tokens        a b c d | e f g h | i j . .
            table         [  b7  ] [  b2  ] [  b9  ]
                          \______________/ \______/
                           cached_block_ids  allocated here: ceil((8 + 2) / 4) - 2 = 1
                           (touched: +1 ref)

          a decode step later (10 prompt tokens + 2 outputs scheduled, 1 new token):

            tokens        a b c d | e f g h | i j k l | m
            table         [  b7  ] [  b2  ] [  b9  ] [  b4  ]   <- 13 tokens need a 4th
                                                                  block: allocated now

        A block is shared (ref_cnt > 1) only while it is full and its chained hash matches;
        the block a request is still writing is always its own.

        With a sliding KV group the request's second table grows alongside, but keeps only
        the blocks the window of the step's first token reaches back to (positions
        first - W + 1 ..); those before become the null block (-), and their blocks are freed
        now. block_size = 4, W = 6:

          a chunk of 6 tokens after 9 computed (first new position 9, which reads 4 ..):

            tokens        a b c d | e f g h | i j k l | m n o .
            full table    [  b7  ] [  b2  ] [  b9  ] [  b4  ]
            sliding       [   -  ] [  s3  ] [  s8  ] [  s1  ]   <- s5 (was block 0) freed;
                                                                   s1 allocated for m n o

          the next decode (position 15, reads 10 ..): block 1 (positions 4 - 7) slides out

            sliding       [   -  ] [   -  ] [  s8  ] [  s1  ]   <- s3 freed

        So after each step a request holds ceil((W - 1) / block_size) + 1 sliding blocks at
        most, beside those of its tokens not yet computed (SlidingKVGroup.blocks_needed);
        `slide` frees the same blocks once a step is computed, for requests that are not
        scheduled again at once. A prefix hit at admission (cached_block_ids) brings the
        sliding blocks of its last window with it, found under the same hashes.
        """
        cached_block_ids = cached_block_ids or []
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = request.num_scheduled_tokens + len(cached_block_ids) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = num_needed - len(table) - len(cached_block_ids)
        num_revived = sum(1 for b in cached_block_ids if self.pool.ref_cnt[b] == 0)
        sliding_hit = self._sliding_blocks_found(request, len(cached_block_ids), num_computed)
        if (num_new_blocks + num_revived > self.pool.num_free_blocks
                or not self._sliding_fits(request, sliding_hit, num_needed, num_computed)):
            if not table:
                del self.block_tables[request.request_id]
            return False
        self.pool.touch(cached_block_ids)
        table.extend(cached_block_ids)
        table.extend(self.pool.allocate(max(num_new_blocks, 0)))
        if self.sliding_pool is not None:
            self._grow_sliding(request, sliding_hit, num_needed, num_computed)
        return True

    def _sliding_blocks_found(self, request: Request, num_cached: int,
                              num_computed: int) -> list[int]:
        """The sliding blocks a prefix hit of num_cached blocks brings (find_cached_prefix
        found them, under the full blocks' hashes): those of its last window."""
        if self.sliding_pool is None or not num_cached:
            return []
        hashes = self.block_hashes[request.request_id]
        found = [self.sliding_pool.lookup(hashes[i])
                 for i in range(self.first_window_block(num_computed), num_cached)]
        if None in found:
            raise RuntimeError("a prefix hit whose window is not in the sliding pool: "
                               "find_cached_prefix and allocate_slots disagree")
        return found

    def _sliding_fits(self, request: Request, hit: list[int], num_needed: int,
                      num_computed: int) -> bool:
        """Whether the sliding pool has the blocks the table's growth needs, counting those
        that slide out of the window first as free."""
        if self.sliding_pool is None:
            return True
        pool, table = self.sliding_pool, self.get_sliding_block_table(request.request_id)
        freed = sum(1 for b in self._slid_out(request, num_computed) if pool.ref_cnt[b] == 1)
        covered = max(len(table), self.first_window_block(num_computed) + len(hit))
        revived = sum(1 for b in hit if pool.ref_cnt[b] == 0)
        return max(num_needed - covered, 0) + revived <= pool.num_free_blocks + freed

    def _slid_out(self, request: Request, position: int) -> list[int]:
        """The request's sliding blocks still held before the window of a query at
        `position`."""
        table = self.sliding_tables.get(request.request_id, [])
        first = min(self.first_window_block(position), len(table))
        return table[self.num_slid_out.get(request.request_id, 0):first]

    def slide(self, request: Request, position: int) -> None:
        """Free the request's sliding blocks wholly before the window of its next query, at
        `position` (none without a sliding group): every step from there on reads none of
        them."""
        if self.sliding_pool is None:
            return
        slid_out = self._slid_out(request, position)
        if not slid_out:
            return
        table = self.sliding_tables[request.request_id]
        start = self.num_slid_out.get(request.request_id, 0)
        null = self.sliding.null_block
        table[start:start + len(slid_out)] = [null] * len(slid_out)
        self.num_slid_out[request.request_id] = start + len(slid_out)
        self.sliding_pool.free(reversed(slid_out))

    def _grow_sliding(self, request: Request, hit: list[int], num_needed: int,
                      num_computed: int) -> None:
        """The sliding table after allocate_slots' full one: slid-out blocks freed, a prefix
        hit's window taken, new blocks to the full table's length."""
        self.slide(request, num_computed)
        table = self.sliding_tables.setdefault(request.request_id, [])
        if not table and num_computed:  # admission after a prefix hit: its window, null before
            first = self.first_window_block(num_computed)
            self.sliding_pool.touch(hit)
            table.extend([self.sliding.null_block] * first + hit)
            self.num_slid_out[request.request_id] = first
        self.num_slid_out.setdefault(request.request_id, 0)
        table.extend(self.sliding_pool.allocate(max(num_needed - len(table), 0)))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks among its first `num_tokens` tokens.

        The caller vouches that their KV is computed, or will be by a step that runs before
        any request that finds them: the scheduler publishes a step's blocks once nothing in
        that schedule() call can drop the step's work for this request. A request admitted
        later in the same step may then share them, since every layer writes the whole step's
        K/V before any request's attention reads it."""
        if not self.enable_prefix_caching:
            return
        num_full_blocks = num_tokens // self.block_size
        start = self.num_published_blocks.get(request.request_id, 0)
        if num_full_blocks <= start:  # most decode steps: no block filled up
            return
        table = self.block_tables[request.request_id]
        hashes = self._full_block_hashes(request, num_full_blocks)
        for i in range(start, num_full_blocks):
            self.pool.cache(table[i], hashes[i])
        if self.sliding_pool is not None:  # those still held (the rest slid out unpublished)
            sliding = self.sliding_tables[request.request_id]
            for i in range(max(start, self.num_slid_out[request.request_id]), num_full_blocks):
                self.sliding_pool.cache(sliding[i], hashes[i])
        self.num_published_blocks[request.request_id] = num_full_blocks

    def withdraw_uncomputed_blocks(self, request: Request) -> list[int]:
        """Un-publish the blocks past the request's computed tokens, because the step that was
        to compute them failed; returns them (other requests may already have found them)."""
        table = self.block_tables.get(request.request_id, [])
        published = self.num_published_blocks.get(request.request_id, 0)
        first = request.num_computed_tokens // self.block_size
        withdrawn = table[first:published]
        for block_id in withdrawn:
            self.pool.evict(block_id)
        sliding = self.get_sliding_block_table(request.request_id)
        for block_id in sliding[max(first, self.num_slid_out.get(request.request_id, 0)):
                                published]:
            self.sliding_pool.evict(block_id)
        self.num_published_blocks[request.request_id] = min(published, first)
        return withdrawn

    def free(self, request: Request) -> None:
        """Return a request's blocks (both groups'); tail blocks first so the shared head
        stays cached longest."""
        table = self.block_tables.pop(request.request_id, [])
        self.block_hashes.pop(request.request_id, None)
        self.num_published_blocks.pop(request.request_id, None)
        self.pool.free(reversed(table))
        if self.sliding_pool is not None:
            sliding = self.sliding_tables.pop(request.request_id, [])
            start = self.num_slid_out.pop(request.request_id, 0)
            self.sliding_pool.free(reversed(sliding[start:]))

    def reset_prefix_cache(self) -> None:
        """Forget every published block, in both groups."""
        self.pool.reset_prefix_cache()
        if self.sliding_pool is not None:
            self.sliding_pool.reset_prefix_cache()

    def _full_block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """The chained hashes of the request's first `num_full_blocks` blocks, and perhaps of
        more (computed once, kept until the request's blocks are freed): read only the first
        `num_full_blocks`."""
        hashes = self.block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(request.token_ids_slice(i * bs, (i + 1) * bs))))
        return hashes
