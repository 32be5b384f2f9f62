"""Which worker replica takes the next request: a pure function over load snapshots.

A replica's load is what it last published with ``record_routing_stats``
(running and waiting requests, free KV blocks), corrected by what this router
has sent it since (Serve's per-handle count of ongoing requests), because
published stats are up to one stats period old and a burst of requests would
otherwise all land on the replica that looked idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pagefleet.worker.stats import ReplicaStats


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    replica_id: str
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_ongoing: int = 0  # requests this router has in flight on the replica
    healthy: bool = True
    published: bool = True  # False: no routing stats yet, ranked on this router's in-flight count alone

    @property
    def num_queued(self) -> int:
        """Requests the replica holds: the larger of its own report and this router's count."""
        return max(self.num_running + self.num_waiting, self.num_ongoing)


def replica_load(replica_id: str, stats: ReplicaStats | None, num_ongoing: int) -> ReplicaLoad:
    """A snapshot from what a worker published; a replica that has not published yet counts
    as empty and healthy (it passed Serve's start-up health check)."""
    if stats is None:
        return ReplicaLoad(replica_id=replica_id, num_ongoing=num_ongoing, published=False)
    engine = stats.engine
    return ReplicaLoad(
        replica_id=replica_id,
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        num_free_blocks=engine.num_free_blocks,
        num_total_blocks=engine.num_total_blocks,
        num_ongoing=num_ongoing,
        healthy=stats.healthy,
    )


def rank_replicas(loads: Sequence[ReplicaLoad]) -> list[str]:
    """Replica ids, best first: healthy before unhealthy, then fewest queued requests,
    then most free KV blocks, then id (so equal replicas rank the same every time)."""
    return [r.replica_id for r in _ordered(loads)]


def _ordered(loads: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    return sorted(loads, key=lambda r: (not r.healthy, r.num_queued, -r.num_free_blocks, r.replica_id))


def routing_reason(loads: Sequence[ReplicaLoad]) -> str:
    """Why ``rank_replicas`` put its first replica first, for the routing-decisions metric:

    ``only_replica``; ``least_queued`` (fewer queued requests than the runner-up);
    ``most_free_blocks`` (queues tied, more free KV blocks); ``tie`` (equal, first by id);
    ``fallback_unhealthy`` (no healthy replica); ``fallback_no_stats`` (the chosen replica
    has published no load yet, so only this router's in-flight count ranked it).
    """
    if not loads:
        raise ValueError("no replicas to route to")
    ordered = _ordered(loads)
    first = ordered[0]
    if not first.healthy:
        return "fallback_unhealthy"
    if not first.published:
        return "fallback_no_stats"
    if len(ordered) == 1:
        return "only_replica"
    second = ordered[1]
    if not second.healthy or first.num_queued < second.num_queued:
        return "least_queued"
    if first.num_free_blocks > second.num_free_blocks:
        return "most_free_blocks"
    return "tie"
