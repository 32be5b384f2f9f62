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

    @property
    def num_queued(self) -> int:
        """Requests the replica holds: the larger of its own report and this router's count."""
        return max(self.num_running + self.num_waiting, self.num_ongoing)


def replica_load(replica_id: str, stats: ReplicaStats | None, num_ongoing: int) -> ReplicaLoad:
    """A snapshot from what a worker published; a replica that has not published yet counts
    as empty and healthy (it passed Serve's start-up health check)."""
    if stats is None:
        return ReplicaLoad(replica_id=replica_id, num_ongoing=num_ongoing)
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
    ordered = sorted(loads, key=lambda r: (not r.healthy, r.num_queued, -r.num_free_blocks, r.replica_id))
    return [r.replica_id for r in ordered]
