"""What the serving layer reads of `engine.core` when the engine runs elsewhere: in the engine
process (`loom.engine.process`) or in Ray replicas (`loom.cluster`). Both clients hand the
server the same `ServedCore`, built from the facts the engine reports once it is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loom.engine.core import EngineCore
    from loom.model.generation_config import SamplingDefaults


@dataclass(frozen=True)
class EngineFacts:
    """The loaded engine's model and KV cache, as the server reports and checks them."""

    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    sampling_defaults: SamplingDefaults  # what requests that set no sampling get

    @classmethod
    def of(cls, core: EngineCore) -> EngineFacts:
        return cls(core.model_name, core.max_model_len, core.num_kv_blocks, core.block_size,
                   core.sampling_defaults)


class ServedCore:
    """`engine.core` for the server: a tokenizer on the server's side, the engine's facts,
    and `metrics` with an (awaitable) `prometheus_text()` that asks the engine for them."""

    def __init__(self, tokenizer: Any, facts: EngineFacts, metrics: Any) -> None:
        self.tokenizer = tokenizer
        self.model_name = facts.model_name
        self.max_model_len = facts.max_model_len
        self.num_kv_blocks = facts.num_kv_blocks
        self.block_size = facts.block_size
        self.sampling_defaults = facts.sampling_defaults
        self.metrics = metrics
