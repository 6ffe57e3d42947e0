"""How much KV cache a model needs, and how many blocks a memory budget holds.

One formula for the whole code base: the engine sizes its cache with it at start-up and
`loom plan` prints what it gives for GPUs that are not here. torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.model.arch import ModelArch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class KVCacheSpec:
    """The per-token KV footprint of a model on one device: K and V for every layer and every
    KV head that device holds. With tensor parallelism each device holds num_kv_heads / TP
    heads; where TP exceeds the KV heads they are replicated, one per device (as vLLM does)."""

    num_layers: int
    num_kv_heads: int  # on this device
    head_dim: int
    dtype_bytes: int

    @classmethod
    def for_model(cls, arch: ModelArch, dtype_bytes: int,
                  tensor_parallel_size: int = 1) -> KVCacheSpec:
        heads = max(1, -(-arch.num_kv_heads // tensor_parallel_size))
        return cls(arch.num_layers, heads, arch.head_dim, dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def num_blocks(self, budget_bytes: int, block_size: int) -> int:
        """Whole blocks that fit in `budget_bytes` (0 if not even one does)."""
        return max(0, budget_bytes // self.bytes_per_block(block_size))
