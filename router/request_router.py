"""pagefleet's Serve request router for the worker deployment (Ray Serve's public API only).

It turns each candidate replica's published routing stats and this handle's
in-flight count into ``ReplicaLoad`` snapshots and asks ``rank_replicas``.
Each replica is its own tier, so Serve tries them in exactly that order and
moves on only when a replica's queue is full. Each choice is counted in
``pagefleet_router_decisions`` by policy and reason.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.routing_policy import rank_replicas, replica_load, routing_reason
from pagefleet.worker.stats import ReplicaStats

REQUEST_ROUTER_CLASS = "pagefleet.router.request_router:LeastLoadedRouter"
POLICY = "least_loaded"


class LeastLoadedRouter(FIFOMixin, RequestRouter):
    _metrics: RouterMetrics | None = None

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [replica_load(rid, ReplicaStats.from_routing_stats(r.routing_stats),
                              self.replica_queue_len_cache.get(r.replica_id) or 0)
                 for rid, r in by_id.items()]
        if loads:
            if self._metrics is None:  # created on first use: the router's base class owns __init__
                self._metrics = RouterMetrics()
            self._metrics.inc("routing_decisions", policy=POLICY, reason=routing_reason(loads))
        return [[by_id[rid]] for rid in rank_replicas(loads)]
