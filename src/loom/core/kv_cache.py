"""Per-request block tables over the block pool, and prefix-cache lookup.

Full blocks are named by a hash chained over (parent hash, token ids of the block), so two
requests share a block only if every token before and inside it is the same.
"""

from __future__ import annotations

from loom.core.block_pool import BlockPool
from loom.request import Request


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[int]] = {}
        self.num_published_blocks: dict[str, int] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

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
        return found

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
        """
        cached_block_ids = cached_block_ids or []
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = request.num_scheduled_tokens + len(cached_block_ids) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = num_needed - len(table) - len(cached_block_ids)
        num_revived = sum(1 for b in cached_block_ids if self.pool.ref_cnt[b] == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request.request_id]
            return False
        self.pool.touch(cached_block_ids)
        table.extend(cached_block_ids)
        table.extend(self.pool.allocate(max(num_new_blocks, 0)))
        return True

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
        self.num_published_blocks[request.request_id] = min(published, first)
        return withdrawn

    def free(self, request: Request) -> None:
        """Return a request's blocks; tail blocks first so the shared head stays cached longest."""
        table = self.block_tables.pop(request.request_id, [])
        self.block_hashes.pop(request.request_id, None)
        self.num_published_blocks.pop(request.request_id, None)
        self.pool.free(reversed(table))

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
