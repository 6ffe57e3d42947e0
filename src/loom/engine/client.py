"""The one contract between the HTTP server and an engine, wherever the engine runs: on a thread
of the server's process (`AsyncEngine`), in a child process (`EngineProcess`), or as replicas
on Ray (`loom.cluster.client.ClusterEngine`). The server sees only `EngineClient`: the loaded
engine's facts, a tokenizer on the server's side, submit and abort, the Prometheus text, the
prefix-cache reset, and the lifecycle the server's start-up and draining shutdown drive."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from loom.outputs import RequestOutput
from loom.sampling import SamplingParams

if TYPE_CHECKING:
    from loom.engine.core import EngineCore
    from loom.model.generation_config import SamplingDefaults


class EngineDeadError(RuntimeError):
    """The step loop is not running (it crashed or was shut down); nothing will be served."""


class RequestRejectedError(RuntimeError):
    """Admission control turned the request away (queue full, or queued too long): retry later."""


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


@dataclass(frozen=True)
class EngineFacts:
    """The loaded engine's model and KV cache, as the server reports and checks them (plain
    data: the engine process and Ray replicas send it once they are loaded)."""

    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    sampling_defaults: SamplingDefaults  # what requests that set no sampling get

    @classmethod
    def of(cls, core: EngineCore) -> EngineFacts:
        return cls(core.model_name, core.max_model_len, core.num_kv_blocks, core.block_size,
                   core.sampling_defaults)

    @property
    def kv_capacity(self) -> int:
        """Tokens the whole KV cache holds: no request may outgrow it."""
        return self.num_kv_blocks * self.block_size


class EngineStream(Protocol):
    """A submission's outputs, a list per step; closing it aborts what has not finished."""

    def __aiter__(self) -> AsyncIterator[list[RequestOutput]]: ...
    async def __anext__(self) -> list[RequestOutput]: ...
    def close(self) -> None: ...


class EngineClient(Protocol):
    """What the server uses of an engine. `reset_prefix_cache` raises NotImplementedError
    (naming why) where the engine cannot (replicas on Ray each hold their own cache)."""

    @property
    def facts(self) -> EngineFacts: ...
    @property
    def tokenizer(self) -> Any: ...  # loom.model.tokenizer.Tokenizer

    def submit(self, requests: list[EngineRequest]) -> EngineStream: ...
    def abort(self, request_id: str) -> None: ...
    async def metrics_text(self) -> bytes: ...
    async def reset_prefix_cache(self) -> None: ...
    def start(self) -> None: ...
    def drain(self) -> None: ...
    def stop(self, reason: str = ...) -> None: ...
    def shutdown(self, timeout: float = ...) -> None: ...
    @property
    def is_alive(self) -> bool: ...
