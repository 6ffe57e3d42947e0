"""loom's routing policy on Ray Serve's own request-router extension point.

Ray Serve asks `choose_replicas` for each request (with its call arguments, which carry the
prompt's block hashes) and tells `on_request_routed` where it went; this class only adapts
Ray's replicas to the policy's stable indices and reads their queue lengths (Ray's cached
counts of requests in flight on each replica, probed when unknown). The policy itself is
`loom.cluster.routing`, the same code the fleet simulator runs.

Ray pickles this module by value to ship the class, so it holds no state of its own at module
level (locks do not pickle): its counters live in `loom.cluster.metrics`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from loom.cluster import metrics as cluster_metrics
from loom.cluster.routing import (
    DEFAULT_IMBALANCE_THRESHOLD,
    UNAVAILABLE,
    PrefixAffinity,
    make_policy,
)

MAX_PENDING_CHOICES = 4096
ROUTED_METHOD = "generate"  # the replica method requests come through (client.py)


class LoomRequestRouter(RequestRouter):
    """Routes each request by `loom.cluster.routing`'s policy; the exact request it was asked
    about gets the replica (no FIFO hand-over: a choice is specific to its prompt)."""

    def initialize_state(self, router: str = "prefix", num_replicas: int = 1, seed: int = 0,
                         imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         **_: Any) -> None:
        self._router = router
        self._policy = make_policy(router, num_replicas, seed=seed,
                                   imbalance_threshold=imbalance_threshold)
        self._slots: dict[ReplicaID, int] = {}  # replica -> the policy's index for it
        # request id -> (decision, hashes) between choice and routing; bounded, since a request
        # cancelled in between is never routed
        self._chosen: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()

    def _slot(self, replica_id: ReplicaID) -> int:
        """A stable index per replica; a replacement takes a freed one, forgetting what the
        replica before it held (its cache died with it)."""
        slot = self._slots.get(replica_id)
        if slot is None:
            used = set(self._slots.values())
            slot = next(i for i in itertools.count() if i not in used)
            if isinstance(self._policy, PrefixAffinity):
                self._policy.forget(slot)
            self._slots[replica_id] = slot
        return slot

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for replica_id in [r for r in self._slots if r not in self._replica_id_set]:
            del self._slots[replica_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._slots.pop(replica_id, None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_slot = {self._slot(r.replica_id): r for r in candidate_replicas}
        lengths = await self._queue_lengths(candidate_replicas)
        queue = [UNAVAILABLE] * (max(self._slots.values()) + 1)
        for slot, replica in by_slot.items():
            length = lengths.get(replica.replica_id)
            if length is not None and length < replica.max_ongoing_requests:
                queue[slot] = length
        hashes = _block_hashes(pending_request)
        chosen = by_slot.get(self._policy.choose(hashes, queue))
        if chosen is None:  # the policy's pick just left: let Ray take the least loaded
            return [candidate_replicas]
        if pending_request is not None:
            self._chosen[pending_request.metadata.internal_request_id] = (
                self._policy.last_decision, hashes)
            while len(self._chosen) > MAX_PENDING_CHOICES:
                self._chosen.popitem(last=False)
        return [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        if pending_request.metadata.call_method != ROUTED_METHOD:
            return  # a control call (model_facts at start-up) is no request the router placed
        decision, hashes = self._chosen.pop(pending_request.metadata.internal_request_id,
                                            (self._policy.last_decision, []))
        self._policy.record(self._slot(replica_id), hashes)
        cluster_metrics.ROUTER_DECISIONS.labels(router=self._router, decision=decision,
                         replica=replica_id.unique_id).inc()

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests in flight per replica: Ray's cache where fresh, else a probe (a replica
        that does not answer is left out, i.e. unavailable)."""
        lengths: dict[ReplicaID, int] = {}
        unknown = []
        for replica in replicas:
            length = self._replica_queue_len_cache.get(replica.replica_id)
            if length is None:
                unknown.append(replica)
            else:
                lengths[replica.replica_id] = length
        for replica, length in await self._probe_queue_lens(unknown, 0) if unknown else []:
            if length is not None:
                lengths[replica.replica_id] = length
        return lengths


def _block_hashes(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None:
        return []
    return list(pending_request.kwargs.get("block_hashes", ()))
