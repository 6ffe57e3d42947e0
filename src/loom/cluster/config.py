"""`loom serve`'s data-parallel options, spelled once: they become flags like every other
option. Importing this module imports no ray: N = 1 stays the in-process server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loom.cluster.routing import DEFAULT_IMBALANCE_THRESHOLD, ROUTERS
from loom.config import option, require_at_least

RouterName = Literal["prefix", "pow2", "round-robin"]
assert ROUTERS == RouterName.__args__  # one list of routers


@dataclass(frozen=True)
class ClusterConfig:
    CLI_GROUP = "Cluster"

    data_parallel_size: int = option(1,
        "engine replicas, each with its own KV cache and --num-threads (one GPU each on "
        "CUDA); above 1 they run on Ray Serve behind this server's one OpenAI API")
    ray_address: str | None = option(None,
        "join this Ray cluster (e.g. ray://head:10001 or auto); none = start a local Ray "
        "instance on this machine")
    router: RouterName = option("prefix",
        "which replica serves a request: prefix = the one holding the longest cached prefix "
        "of its prompt unless its queue is much longer, pow2 = the shorter queue of two "
        "random replicas, round-robin = each in turn")
    router_imbalance_threshold: int = option(DEFAULT_IMBALANCE_THRESHOLD,
        "with --router prefix: requests a replica's queue may exceed the shortest one's "
        "before its cached prefix is given up for the shorter queue")

    def __post_init__(self) -> None:
        require_at_least(1, {"data_parallel_size": self.data_parallel_size})
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        require_at_least(0, {"router_imbalance_threshold": self.router_imbalance_threshold})
