"""How much KV cache a model needs, and how many blocks a memory budget holds.

One formula for the whole code base: the engine sizes its cache with it at start-up and
`loom plan` prints what it gives for GPUs that are not here. torch-free.

A model with sliding-window layers (Gemma 2/3, gpt-oss, Mistral with `sliding_window`) keeps
their K/V in a KV group of its own, whose pool holds each running request's window rather than
its context (core/kv_cache.py): `KVCacheSpec.layout` takes that pool out of the budget first,
then gives the full-attention layers the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.core.batch import SlidingKVGroup
from loom.model.arch import ModelArch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class KVCacheLayout:
    """The blocks of each KV group: `num_blocks` for the full-attention layers (the pool the
    scheduler admits against) and, where sliding layers keep a group of their own,
    `num_sliding_blocks` for them."""

    block_size: int
    num_blocks: int
    full_bytes_per_block: int  # K and V of one block in every full-attention layer
    num_sliding_blocks: int = 0
    sliding_bytes_per_block: int = 0  # ... in every sliding layer (0 without the group)
    sliding_window: int | None = None

    @property
    def sliding_group(self) -> SlidingKVGroup | None:
        if self.sliding_window is None:
            return None
        return SlidingKVGroup(self.sliding_window, self.num_sliding_blocks)

    @property
    def full_bytes(self) -> int:
        return self.num_blocks * self.full_bytes_per_block

    @property
    def sliding_bytes(self) -> int:
        return self.num_sliding_blocks * self.sliding_bytes_per_block


@dataclass(frozen=True)
class KVCacheSpec:
    """The per-token KV footprint of a model on one device: K and V for every layer and every
    KV head that device holds. With tensor parallelism each device holds num_kv_heads / TP
    heads; where TP exceeds the KV heads they are replicated, one per device (as vLLM does).
    Of the layers, num_sliding_layers attend in a window of sliding_window positions."""

    num_layers: int
    num_kv_heads: int  # on this device
    head_dim: int
    dtype_bytes: int
    num_sliding_layers: int = 0
    sliding_window: int | None = None

    @classmethod
    def for_model(cls, arch: ModelArch, dtype_bytes: int,
                  tensor_parallel_size: int = 1) -> KVCacheSpec:
        heads = max(1, -(-arch.num_kv_heads // tensor_parallel_size))
        sliding = sum(sliding_layers(arch))
        if not sliding:
            return cls(arch.num_layers, heads, arch.head_dim, dtype_bytes)
        return cls(arch.num_layers, heads, arch.head_dim, dtype_bytes, sliding,
                   arch.sliding_window)

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K and V of one token, as where every layer keeps the whole context."""
        return self.num_layers * self._layer_bytes_per_token

    @property
    def _layer_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def num_blocks(self, budget_bytes: int, block_size: int) -> int:
        """Whole blocks that fit in `budget_bytes` with every layer keeping the whole context
        (0 if not even one does)."""
        return max(0, budget_bytes // self.bytes_per_block(block_size))

    def keeps_sliding_group(self, max_model_len: int) -> bool:
        """Whether the sliding layers keep a KV group of their own: they have a window
        shorter than the longest context."""
        return self.sliding_window is not None and self.sliding_window < max_model_len

    def layout(self, block_size: int, max_model_len: int, max_num_seqs: int,
               max_num_batched_tokens: int, budget_bytes: int | None = None,
               num_blocks: int | None = None) -> KVCacheLayout:
        """The blocks of each group for a memory budget, or for a given count of full-group
        blocks (num_blocks). The sliding pool is what the scheduler's limits can ever hold
        (SlidingKVGroup.blocks_needed), never more than the full group's count: a request's
        sliding blocks are some of its full ones, so where the budget is too small for
        separate windows both groups get the same count (as many as without the group).
        With no full-attention layer at all the full group is bookkeeping, no memory: enough
        blocks for max_num_seqs requests of max_model_len, and the budget is the sliding
        pool's. Raises ValueError when the budget holds no block."""
        if not self.keeps_sliding_group(max_model_len):
            bytes_per_block = self.bytes_per_block(block_size)
            count = num_blocks if num_blocks is not None else budget_bytes // bytes_per_block
            return KVCacheLayout(block_size, _at_least_one(count, budget_bytes, bytes_per_block),
                                 bytes_per_block)
        full_bpb = (self.num_layers - self.num_sliding_layers) * self._layer_bytes_per_token \
            * block_size
        sliding_bpb = self.num_sliding_layers * self._layer_bytes_per_token * block_size
        needed = SlidingKVGroup.blocks_needed(self.sliding_window, block_size, max_num_seqs,
                                              max_num_batched_tokens)
        if num_blocks is not None:
            full, sliding = num_blocks, min(needed, num_blocks)
        elif full_bpb == 0:
            sliding = _at_least_one(min(needed, budget_bytes // sliding_bpb), budget_bytes,
                                    sliding_bpb)
            full = max_num_seqs * -(-max_model_len // block_size)
        elif needed * (full_bpb + sliding_bpb) >= budget_bytes:
            full = sliding = _at_least_one(budget_bytes // (full_bpb + sliding_bpb),
                                           budget_bytes, full_bpb + sliding_bpb)
        else:
            full, sliding = (budget_bytes - needed * sliding_bpb) // full_bpb, needed
        return KVCacheLayout(block_size, full, full_bpb, sliding, sliding_bpb,
                             self.sliding_window)


def sliding_layers(arch: ModelArch) -> list[bool]:
    """Per layer, whether it attends in a sliding window (transformers' "sliding_attention"
    layer type, with the model's sliding_window)."""
    types = arch.layer_types or ("full_attention",) * arch.num_layers
    return [arch.sliding_window is not None and t == "sliding_attention" for t in types]


def _at_least_one(count: int, budget_bytes: int | None, bytes_per_block: int) -> int:
    if count < 1:
        raise ValueError(f"KV cache budget {budget_bytes} bytes is less than one block "
                         f"({bytes_per_block} bytes)")
    return count
