"""The front end's engine client over the replicas: `loom.engine.client.EngineClient` (the
replicas' facts and a tokenizer here, submit, abort, every replica's metrics in one text, the
lifecycle), so `build_app` serves N replicas exactly as it serves one engine.

Each HTTP request becomes one streaming call on the replica deployment's handle, carrying the
prompt's block hashes for the router. A replica that dies mid-stream surfaces as
EngineDeadError (a 503 or an SSE error event), never a hang: Ray ends the call with an error
when the replica's actor dies.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import generate_latest
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from loom.cluster.metrics import ROUTER_REGISTRY, merge_replica_texts
from loom.cluster.ray_router import ROUTED_METHOD
from loom.cluster.replica import DEAD, INVALID, REJECTED, ModelFacts
from loom.cluster.routing import prompt_block_hashes
from loom.engine.async_engine import EngineDeadError, EngineRequest, RequestRejectedError
from loom.engine.client import EngineFacts
from loom.engine.output_delta import DeltaDecoder
from loom.outputs import RequestOutput

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 2.0
REPLICA_DIED = "the replica serving this request stopped; retry (it is being restarted)"


class ClusterMetrics:
    """/metrics of the cluster: every replica's series labelled `replica`, and the router's
    decisions, in one scrape. Each fetch also counts the replicas that reported lately."""

    def __init__(self, hub: Any, num_replicas: int) -> None:
        self._hub = hub
        self.live_replicas = num_replicas  # deployed and ready when this is made

    async def replica_texts(self) -> dict[str, bytes]:
        texts = await self._hub.get.remote()
        self.live_replicas = len(texts)
        return texts

    async def prometheus_text(self) -> bytes:
        return merge_replica_texts(await self.replica_texts()) + generate_latest(ROUTER_REGISTRY)


class RemoteStream:
    """One HTTP request's outputs from the replica the router chose: an async iterator of
    lists of RequestOutput, like AsyncEngine's OutputStream. `close` cancels the call, which
    aborts the requests on the replica and frees their KV blocks."""

    def __init__(self, client: ClusterEngine, requests: list[EngineRequest],
                 call: DeploymentResponseGenerator) -> None:
        self._client = client
        self._ids = [r.request_id for r in requests]
        self._unfinished = set(self._ids)
        self._call = call
        self._closed = False
        self._decoder = DeltaDecoder()

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self._closed or not self._unfinished:
            raise StopAsyncIteration
        try:
            kind, value = await self._call.__anext__()
        except StopAsyncIteration:
            self._end()
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or is unreachable
            if self._closed:  # cancelled by `close`, while this read waited
                raise StopAsyncIteration from e
            self._end()
            logger.warning("Request %s failed on its replica: %s", self._ids[0], e)
            raise EngineDeadError(REPLICA_DIED) from e
        if kind != "outputs":
            self._end()
            raise {REJECTED: RequestRejectedError, INVALID: ValueError,
                   DEAD: EngineDeadError}[kind](value)
        outputs = [self._decoder.decode(delta) for delta in value]
        for output in outputs:
            if output.finished:
                self._unfinished.discard(output.request_id)
        if not self._unfinished:
            self._end()
        return outputs

    def _end(self) -> None:
        self._closed = True
        self._client.forget(self._ids)

    def close(self) -> None:
        """Cancel the call if it has not finished (the client left or failed); idempotent."""
        if not self._closed:
            self._call.cancel()
            self._end()


class ClusterEngine:
    """An engine client over the replica deployment's handle (see the module docstring)."""

    def __init__(self, handle: DeploymentHandle, facts: ModelFacts, hub: Any,
                 num_replicas: int) -> None:
        self.facts: EngineFacts = facts.engine
        self.tokenizer = facts.tokenizer
        self.metrics = ClusterMetrics(hub, num_replicas)
        self._handle = handle.options(stream=True, method_name=ROUTED_METHOD)
        self._streams: dict[str, RemoteStream] = {}
        self._draining = False
        self._stopped: str | None = None
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        """The replicas started with the deployment; on the server's event loop, watch how
        many of them report, for /health."""
        self._watch = asyncio.get_running_loop().create_task(self._watch_replicas())

    async def _watch_replicas(self) -> None:
        while self._stopped is None:
            try:
                await self.metrics.replica_texts()
            except Exception:  # noqa: BLE001 - Ray is going away; /health says so
                self.metrics.live_replicas = 0
            await asyncio.sleep(HEALTH_POLL_S)

    async def metrics_text(self) -> bytes:
        return await self.metrics.prometheus_text()

    async def reset_prefix_cache(self) -> None:
        raise NotImplementedError("reset_prefix_cache is not available with "
                                  "--data-parallel-size above 1; restart the server instead")

    def drain(self) -> None:
        self._draining = True

    def stop(self, reason: str = "the engine was shut down") -> None:
        """Abort every request in flight; later submissions fail with `reason`."""
        self._stopped = reason
        if self._watch is not None:
            self._watch.cancel()
        for stream in list(self._streams.values()):
            stream.close()

    def shutdown(self, timeout: float = 30.0) -> None:
        self.stop()

    @property
    def is_alive(self) -> bool:
        """Serving, with at least one replica reporting (Serve restarts the others)."""
        return self._stopped is None and self.metrics.live_replicas > 0

    def submit(self, requests: list[EngineRequest]) -> RemoteStream:
        """Send the requests (one prompt, n choices, or several prompts) to one replica."""
        if self._stopped is not None:
            raise EngineDeadError(self._stopped)
        if self._draining:
            raise RequestRejectedError("the server is shutting down; retry elsewhere or later")
        hashes = prompt_block_hashes(requests[0].prompt_token_ids, self.facts.block_size)
        stream = RemoteStream(self, requests, self._handle.remote(requests, block_hashes=hashes))
        for request in requests:
            self._streams[request.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Abort the call carrying this request (with the requests it was sent with)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.close()

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)
