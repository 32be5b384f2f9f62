"""Which worker replica takes the next request: a pure function over load snapshots.

A replica's load is what it last published with ``record_routing_stats``
(running and waiting requests, free KV blocks), corrected by what this router
has sent it since (Serve's per-handle count of ongoing requests), because
published stats are up to one stats period old and a burst of requests would
otherwise all land on the replica that looked idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence


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


def load_from_routing_stats(replica_id: str, stats: Mapping[str, Any] | None, num_ongoing: int) -> ReplicaLoad:
    """A snapshot from the dict a worker published; a replica that has not published yet
    counts as empty and healthy (it passed Serve's start-up health check)."""
    stats = stats or {}
    return ReplicaLoad(
        replica_id=replica_id,
        num_running=int(stats.get("num_running", 0)),
        num_waiting=int(stats.get("num_waiting", 0)),
        num_free_blocks=int(stats.get("num_free_blocks", 0)),
        num_total_blocks=int(stats.get("num_total_blocks", 0)),
        num_ongoing=num_ongoing,
        healthy=bool(stats.get("healthy", True)),
    )


def rank_replicas(loads: Sequence[ReplicaLoad]) -> list[str]:
    """Replica ids, best first: healthy before unhealthy, then fewest queued requests,
    then most free KV blocks, then id (so equal replicas rank the same every time)."""
    ordered = sorted(loads, key=lambda r: (not r.healthy, r.num_queued, -r.num_free_blocks, r.replica_id))
    return [r.replica_id for r in ordered]
