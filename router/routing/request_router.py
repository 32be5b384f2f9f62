"""pagefleet's Serve request routers for the worker deployment (Ray Serve's public API only).

One class per ``--routing`` policy; each turns the candidate replicas into
ranked tiers (one replica per tier, so Serve tries them in exactly that order
and moves on only when a replica's queue is full) with a pure function from
``policies`` / ``prefix_table``. Loads are in sequences: the replica's
published stats, or the sequences this router has in flight on it (tracked
from Serve's routed/completed callbacks) when that is more.

``KVRouter`` asks nothing itself: the ingress ranked the workers with its
copy of the global scheduler's view before sending (where admission control
can still answer 429), and the ranking travels in the ``WorkerRequest``.
Without one (the copy has heard of no worker yet) it falls back to the power
of two choices. Nothing here
blocks: ``choose_replicas`` only computes. Each choice is counted in
``pagefleet_router_decisions`` by policy and reason (kv's by the ingress,
which knows the scheduler's reason).

A replica's delta channel (``ChannelOpen``, ``worker.replica.wire``) goes to the replica it
names and nowhere else, whatever the policy, and counts no sequences. ``routable`` tells the
ingress whether a replica is still one Serve routes to (one Serve is stopping is not), before it
sends a request on that replica's channel connection instead of through Serve.

Every router is FIFO (``FIFOMixin``): Serve gives each choice to the oldest
pending request. It has to be: the handle calls of one HTTP request (a
completions request with several prompts) share Serve's internal request id,
which is what the default matching keys on, and all but one would never be
routed. Since ``choose_replicas`` never awaits, a choice normally goes to the
request it was made for; only when Serve has to probe a replica's queue
length (an await) can two routing tasks finish out of order and swap.
"""

from __future__ import annotations

import importlib
import random
import weakref
from collections import Counter
from typing import Any, List, Optional, TypeVar

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.routing.policies import (
    LOAD_REASONS,
    ReplicaLoad,
    pick_two,
    rank_replicas,
    replica_load,
    round_robin,
    routing_reason,
)
from pagefleet.router.routing.prefix_table import PREFIX_REASONS, PrefixTable
from pagefleet.worker.core.block_hash import PackedHashes
from pagefleet.worker.metrics.stats import ReplicaStats
from pagefleet.worker.replica.wire import ChannelOpen, WorkerRequest

_MODULE = "pagefleet.router.routing.request_router"
T = TypeVar("T")

# (app, deployment) -> a request router of it in this process (Serve makes them, for each handle).
_ROUTERS: dict[tuple[str, str], weakref.ReferenceType] = {}


def routable(app_name: str, deployment_name: str, replica_id: str) -> bool:
    """Whether a request router of the deployment in this process has ``replica_id`` among the
    replicas it routes to now (False when there is no such router here)."""
    ref = _ROUTERS.get((app_name, deployment_name))
    router = ref() if ref is not None else None
    return router is not None and any(r.unique_id == replica_id for r in router.curr_replicas)


def _argument(pending_request: Optional[PendingRequest], kind: type[T]) -> T | None:
    """The call's argument if it is a ``kind`` (a ``WorkerRequest``, a ``ChannelOpen``), else None."""
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, kind) else None


def _worker_request(pending_request: Optional[PendingRequest]) -> WorkerRequest | None:
    return _argument(pending_request, WorkerRequest)


def _channel_open(pending_request: Optional[PendingRequest]) -> ChannelOpen | None:
    return _argument(pending_request, ChannelOpen)


class _PagefleetRouter(FIFOMixin, RequestRouter):
    """What every policy shares: loads in sequences, turning an id ranking into tiers, and
    channels pinned to their replica. Each policy implements ``choose``, and names the reasons it
    counts its decisions by (their series start at 0)."""

    POLICY: str | None = None
    REASONS: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (replica, internal request id) -> sequences of each request in flight; a list because
        # the prompts of one HTTP request share the internal id
        self._in_flight: dict[tuple[ReplicaID, str], list[int]] = {}
        self._in_flight_seqs: Counter = Counter()  # replica -> sequences in flight from this router
        self.metrics = RouterMetrics()
        if self.POLICY is not None:
            self.metrics.start_at_zero("routing_decisions",
                                       *({"policy": self.POLICY, "reason": r} for r in self.REASONS))
        deployment = getattr(self, "_deployment_id", None)
        if deployment is not None:
            # Through the imported module: Serve may hand this process the class pickled by value,
            # whose globals (this module's registry among them) are then a copy of their own.
            registry = importlib.import_module(_MODULE)._ROUTERS
            registry[(deployment.app_name, deployment.name)] = weakref.ref(self)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Every choice here is the whole ranking, so Serve should back off before asking again
            # when it found no room; without this it asks again at once, and a choice of no replica
            # at all (a channel to a replica that is gone) turns into a loop that never yields the
            # event loop (Serve backs off only when a locality mixin says so).
            pending_request.routing_context.should_backoff = True
        channel = _channel_open(pending_request)
        if channel is not None:  # its replica or none (a replica that is gone is never a candidate)
            return [[r] for r in candidate_replicas if r.replica_id.unique_id == channel.replica_id]
        return await self.choose(candidate_replicas, pending_request)

    async def choose(self, candidate_replicas: List[RunningReplica],
                     pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        raise NotImplementedError

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _worker_request(pending_request)
        n = request.params.n if request is not None else 0 if _channel_open(pending_request) else 1
        self._in_flight.setdefault((replica_id, pending_request.metadata.internal_request_id), []).append(n)
        self._in_flight_seqs[replica_id] += n

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = (replica_id, internal_request_id)
        entry = self._in_flight.get(key)
        if entry:
            self._in_flight_seqs[replica_id] -= entry.pop()
            if not entry:
                del self._in_flight[key]

    def loads(self, candidates: List[RunningReplica]) -> list[ReplicaLoad]:
        return [replica_load(r.replica_id.unique_id, ReplicaStats.from_routing_stats(r.routing_stats),
                             self._in_flight_seqs[r.replica_id]) for r in candidates]

    @staticmethod
    def tiers(candidates: List[RunningReplica], ranking: list[str]) -> List[List[RunningReplica]]:
        """One tier per ranked replica that is a candidate, then the unranked ones together."""
        by_id = {r.replica_id.unique_id: r for r in candidates}
        ranked = [by_id[rid] for rid in dict.fromkeys(ranking) if rid in by_id]
        rest = [r for r in candidates if r not in ranked]
        return [[r] for r in ranked] + ([rest] if rest else [])


class LeastLoadedRouter(_PagefleetRouter):
    POLICY, REASONS = "least_loaded", LOAD_REASONS

    async def choose(self, candidate_replicas: List[RunningReplica],
                     pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        loads = self.loads(candidate_replicas)
        if loads:
            self.metrics.inc("routing_decisions", policy="least_loaded", reason=routing_reason(loads))
        return self.tiers(candidate_replicas, rank_replicas(loads))


class PowerOfTwoRouter(_PagefleetRouter):
    POLICY, REASONS = "pow2", LOAD_REASONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng = random.Random()

    async def choose(self, candidate_replicas: List[RunningReplica],
                     pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        loads = self.loads(candidate_replicas)
        two = pick_two(loads, self.rng)
        if two:
            self.metrics.inc("routing_decisions", policy="pow2",
                             reason=routing_reason([r for r in loads if r.replica_id in two]))
        return self.tiers(candidate_replicas, two)


class RoundRobinRouter(_PagefleetRouter):
    POLICY, REASONS = "round_robin", ("turn",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turn = 0

    async def choose(self, candidate_replicas: List[RunningReplica],
                     pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        self.metrics.inc("routing_decisions", policy="round_robin", reason="turn")
        self.turn += 1
        return self.tiers(candidate_replicas,
                          round_robin([r.replica_id.unique_id for r in candidate_replicas], self.turn))


class PrefixRouter(_PagefleetRouter):
    """Routes by what this router remembers sending where (it never sees the caches)."""

    POLICY, REASONS = "prefix", PREFIX_REASONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.table = PrefixTable()

    async def choose(self, candidate_replicas: List[RunningReplica],
                     pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        request = _worker_request(pending_request)
        hashes = PackedHashes(request.block_hashes) if request is not None else []
        ranking, reason = self.table.rank(hashes, self.loads(candidate_replicas))
        self.metrics.inc("routing_decisions", policy="prefix", reason=reason)
        return self.tiers(candidate_replicas, ranking)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        request = _worker_request(pending_request)
        if request is not None and request.block_hashes:
            self.table.record(PackedHashes(request.block_hashes), replica_id.unique_id)


class KVRouter(_PagefleetRouter):
    """Applies the global scheduler's ranking carried by the request; pow2 without one. (Its
    decisions are counted where they are made: ``kv_routing.KVRoutingClient``.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng = random.Random()

    async def choose(self, candidate_replicas: List[RunningReplica],
                     pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        request = _worker_request(pending_request)
        if request is not None and request.ranking:
            return self.tiers(candidate_replicas, request.ranking)
        return self.tiers(candidate_replicas, pick_two(self.loads(candidate_replicas), self.rng))


ROUTER_CLASSES = {
    "kv": f"{_MODULE}:KVRouter",
    "least_loaded": f"{_MODULE}:LeastLoadedRouter",
    "pow2": f"{_MODULE}:PowerOfTwoRouter",
    "round_robin": f"{_MODULE}:RoundRobinRouter",
    "prefix": f"{_MODULE}:PrefixRouter",
    # Ray Serve LLM's own, imported only when picked
    "ray_prefix": "pagefleet.router.routing.ray_prefix_router:RayPrefixCacheRouter",
}
