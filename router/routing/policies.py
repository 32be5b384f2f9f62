"""The local routing policies: pure functions over load snapshots, no Ray.

A replica's load is counted in *sequences* everywhere (a request with n=4 is
four): what it last published with ``record_routing_stats`` (running and
waiting sequences), or what this router has sent it since when that is more,
because published stats are up to one stats period old and a burst would
otherwise all land on the replica that looked idle.

``kv`` routing ranks with the global scheduler's view instead (``kv_routing``);
these are the other policies, and ``pick_two`` is also ``kv``'s choice for a
request routed before the ingress's copy of that view knows any worker.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from pagefleet.worker.metrics.stats import ReplicaStats

POLICIES = ("kv", "least_loaded", "pow2", "round_robin", "prefix", "ray_prefix")


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    replica_id: str
    num_running: int = 0  # sequences, as the replica last published
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_in_flight: int = 0  # sequences of the requests this router has in flight on the replica
    healthy: bool = True
    published: bool = True  # False: no routing stats yet, ranked on this router's in-flight count alone

    @property
    def num_queued(self) -> int:
        """Sequences the replica holds: the larger of its own report and this router's count."""
        return max(self.num_running + self.num_waiting, self.num_in_flight)


def replica_load(replica_id: str, stats: ReplicaStats | None, num_in_flight: int) -> ReplicaLoad:
    """A snapshot from what a worker published; a replica that has not published yet counts
    as empty and healthy (it passed Serve's start-up health check)."""
    if stats is None:
        return ReplicaLoad(replica_id=replica_id, num_in_flight=num_in_flight, published=False)
    engine = stats.engine
    return ReplicaLoad(
        replica_id=replica_id,
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        num_free_blocks=engine.num_free_blocks,
        num_total_blocks=engine.num_total_blocks,
        num_in_flight=num_in_flight,
        healthy=stats.healthy,
    )


def _load_key(r: ReplicaLoad) -> tuple:
    return (not r.healthy, r.num_queued, -r.num_free_blocks)


def rank_replicas(loads: Sequence[ReplicaLoad]) -> list[str]:
    """``least_loaded``: replica ids, best first: healthy before unhealthy, then fewest queued
    sequences, then most free KV blocks, then id (so equal replicas rank the same every time)."""
    return [r.replica_id for r in _ordered(loads)]


def _ordered(loads: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    return sorted(loads, key=lambda r: (*_load_key(r), r.replica_id))


# Every reason ``routing_reason`` gives.
LOAD_REASONS = ("only_replica", "least_queued", "most_free_blocks", "tie", "fallback_unhealthy", "fallback_no_stats")


def routing_reason(loads: Sequence[ReplicaLoad]) -> str:
    """Why ``rank_replicas`` put its first replica first, for the routing-decisions metric:

    ``only_replica``; ``least_queued`` (fewer queued sequences than the runner-up);
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


def pick_two(loads: Sequence[ReplicaLoad], rng: random.Random) -> list[str]:
    """``pow2``: two replicas drawn at random, the less loaded first, a tie in random order (the
    power of two choices: nearly least-loaded balance without routers herding onto one replica)."""
    two = rng.sample(list(loads), min(2, len(loads)))
    return [r.replica_id for r in sorted(two, key=_load_key)]


def round_robin(replica_ids: Sequence[str], turn: int) -> list[str]:
    """``round_robin``: the ``turn``-th replica in id order first, the others after it in order."""
    ids = sorted(replica_ids)
    if not ids:
        return []
    start = turn % len(ids)
    return ids[start:] + ids[:start]
