"""Start (or join) Ray, deploy N loom replicas on Ray Serve, and return the engine client the
HTTP front end serves. Ray Serve's own HTTP proxy stays off: loom's server is the front end
(its guards, admission answers and drain), and calls the replicas through a deployment
handle, whose request router is loom's."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from loom import host
from loom.admission import AdmissionConfig
from loom.cluster.client import ClusterEngine
from loom.cluster.config import ClusterConfig
from loom.cluster.replica import MetricsHub, deployment
from loom.config import EngineConfig

logger = logging.getLogger(__name__)

APP_PREFIX = "loom"
# Calls a replica accepts at once: every HTTP request, queued or running, goes to its
# engine's own scheduler and admission control, never to a queue in Ray's router.
MAX_ONGOING_REQUESTS = 4096


@dataclass
class Cluster:
    """A deployed application; `shutdown` removes it (and stops Ray if this process started
    it)."""

    app_name: str
    engine: ClusterEngine
    hub: Any
    owns_ray: bool

    def shutdown(self) -> None:
        """Stopping the local Ray instance takes the replicas with it, and needs no answer
        from Serve's controller (which may already be gone, e.g. after a SIGTERM to the
        whole process group); on a shared cluster only this application is deleted."""
        if self.owns_ray:
            ray.shutdown()
        else:
            serve.delete(self.app_name, _blocking=False)
            ray.kill(self.hub)


def init_ray(config: ClusterConfig, engine_config: EngineConfig) -> bool:
    """Join `ray_address`, or start a local instance sized for the replicas (one logical CPU
    per engine thread, at least the cores this process may use); True if a local instance was
    started here (and is this process's to stop)."""
    if ray.is_initialized():
        return False
    if config.ray_address is not None:
        ray.init(address=config.ray_address, log_to_driver=True)
        return False
    threads = engine_config.model.num_threads or 1
    ray.init(num_cpus=max(host.usable_cpus(), config.data_parallel_size * threads),
             include_dashboard=False, log_to_driver=True,
             _temp_dir=tempfile.mkdtemp(prefix="loom-ray-"))
    return True


def deploy(config: ClusterConfig, engine_config: EngineConfig, limits: AdmissionConfig,
           app_name: str = APP_PREFIX) -> Cluster:
    """Deploy `config.data_parallel_size` replicas as `app_name` and wait until all run."""
    owns_ray = init_ray(config, engine_config)
    serve.start(proxy_location="Disabled")
    hub_name = f"{app_name}-metrics-{os.getpid()}"
    hub = MetricsHub.options(name=hub_name).remote()
    router_kwargs = {"router": config.router, "num_replicas": config.data_parallel_size,
                     "imbalance_threshold": config.router_imbalance_threshold}
    app = deployment(engine_config, limits, hub_name, config.data_parallel_size, router_kwargs,
                     MAX_ONGOING_REQUESTS)
    logger.info("Deploying %d loom replicas on Ray Serve (router: %s)",
                config.data_parallel_size, config.router)
    handle = serve.run(app, name=app_name, route_prefix=None)
    facts = handle.model_facts.remote().result()
    engine = ClusterEngine(handle, facts, hub, config.data_parallel_size)
    return Cluster(app_name, engine, hub, owns_ray)
