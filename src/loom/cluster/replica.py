"""One engine replica as a Ray Serve deployment: an `AsyncEngine(EngineCore(config))` of its own
(KV cache, threads), streaming each call's outputs back to the front end.

Outcomes travel as tagged items rather than raised exceptions, so the front end tells "the
engine refused" (503, 400) from "the replica died" (the handle raises) without depending on
how Ray wraps a remote exception. Every replica pushes its Prometheus text to one named
`MetricsHub` actor, so one scrape of the front end shows every replica's series.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from loom.admission import AdmissionConfig
from loom.config import EngineConfig
from loom.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    RequestRejectedError,
)
from loom.engine.client import EngineFacts
from loom.engine.output_delta import DeltaEncoder

logger = logging.getLogger(__name__)

METRICS_PUSH_INTERVAL_S = 1.0
METRICS_STALE_AFTER_S = 5 * METRICS_PUSH_INTERVAL_S
# What a replica yields: ("outputs", [OutputDelta, ...]) as they come (RemoteStream rebuilds the
# RequestOutputs), or one of these with a message, after which the call ends.
REJECTED, INVALID, DEAD = "rejected", "invalid", "dead"


@dataclass(frozen=True)
class ModelFacts:
    """What the front end needs of the model to validate and tokenize requests itself."""

    tokenizer: Any
    engine: EngineFacts


@ray.remote(num_cpus=0)
class MetricsHub:
    """The newest Prometheus text of every live replica, by replica tag. A replica that
    stopped pushing (it died) drops out after a few push intervals."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def drop(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def get(self) -> dict[str, bytes]:
        oldest = time.monotonic() - METRICS_STALE_AFTER_S
        self._texts = {r: (t, text) for r, (t, text) in self._texts.items() if t >= oldest}
        return {r: text for r, (_, text) in self._texts.items()}


class LoomReplica:
    """The deployment class; `deployment()` wraps it with the cluster's options."""

    def __init__(self, config: EngineConfig, limits: AdmissionConfig, hub_name: str) -> None:
        self.tag = serve.get_replica_context().replica_id.unique_id
        logging.basicConfig(  # the tag is the `replica` label of this replica's metrics
            level=logging.INFO,
            format=f"%(asctime)s %(levelname)s %(name)s [replica {self.tag}]: %(message)s")
        self.engine = AsyncEngine.from_config(config, limits.max_num_queued_reqs,
                                              limits.queue_timeout_s)
        self.engine.start()
        self._hub = ray.get_actor(hub_name)
        self._stop = threading.Event()
        threading.Thread(target=self._push_metrics, name="loom-metrics-push", daemon=True).start()
        logger.info("Replica %s serving %s", self.tag, self.engine.facts.model_name)

    def model_facts(self) -> ModelFacts:
        return ModelFacts(self.engine.tokenizer, self.engine.facts)

    async def generate(self, requests: list[EngineRequest],
                       block_hashes: list[int]) -> AsyncIterator[tuple[str, Any]]:
        """Stream one front-end request's outputs. `block_hashes` is for the router (it reads
        the call's arguments); the engine finds cached blocks itself. A cancelled call (the
        client left, or the front end closed the stream) aborts the engine requests, which
        frees their KV blocks at the top of the next step."""
        del block_hashes
        try:
            stream = self.engine.submit(requests)
        except RequestRejectedError as e:
            yield REJECTED, str(e)
            return
        except EngineDeadError as e:
            yield DEAD, str(e)
            return
        encoder = DeltaEncoder()  # each output as what it added (loom.engine.output_delta)
        try:
            async for outputs in stream:
                yield "outputs", [encoder.encode(output) for output in outputs]
        except ValueError as e:
            yield INVALID, str(e)
        except RequestRejectedError as e:
            yield REJECTED, str(e)
        except EngineDeadError as e:
            yield DEAD, str(e)
        finally:
            stream.close()

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if not self.engine.is_alive:
            raise RuntimeError("the engine loop of this replica is not running")

    def _push_metrics(self) -> None:
        while not self._stop.wait(METRICS_PUSH_INTERVAL_S):
            try:
                self._hub.put.remote(self.tag, self.engine.core.metrics.prometheus_text())
            except Exception:  # noqa: BLE001 - the hub is gone: the cluster is shutting down
                return

    def __del__(self) -> None:
        """Serve calls this when it stops the replica (scale-down, redeploy, shutdown)."""
        self._stop.set()
        self._hub.drop.remote(self.tag)
        self.engine.shutdown(timeout=5.0)


def deployment(config: EngineConfig, limits: AdmissionConfig, hub_name: str, num_replicas: int,
               router_kwargs: dict[str, Any], max_ongoing_requests: int) -> serve.Application:
    """The replicas as a Serve application, routed by loom's RequestRouter."""
    from ray.serve.config import RequestRouterConfig

    num_cpus = config.model.num_threads or 1
    options = {"num_cpus": num_cpus}
    if _has_gpu():
        options["num_gpus"] = 1
    return serve.deployment(
        LoomReplica, name="LoomReplica", num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests, ray_actor_options=options,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        logging_config={"enable_access_log": False},  # the front end logs each request
        request_router_config=RequestRouterConfig(
            request_router_class="loom.cluster.ray_router.LoomRequestRouter",
            request_router_kwargs=router_kwargs),
    ).bind(config, limits, hub_name)


def _has_gpu() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
