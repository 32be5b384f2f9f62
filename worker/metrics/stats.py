"""Engine and replica counters, as plain data (published to routers and metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# The key under which a worker replica's ``record_routing_stats`` dict carries its ReplicaStats
# (Ray Serve's routing stats are a dict; ours is one typed value in it).
ROUTING_STATS_KEY = "pagefleet"


@dataclass(slots=True)
class EngineStats:
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int     # of those, tokens served from the cache
    num_preemptions: int
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int


@dataclass(slots=True)
class ReplicaStats:
    """What a worker replica publishes to the request routers every stats period."""

    replica_id: str
    healthy: bool
    num_requests_total: int
    engine: EngineStats

    def to_routing_stats(self) -> dict[str, Any]:
        return {ROUTING_STATS_KEY: self}

    @staticmethod
    def from_routing_stats(stats: Mapping[str, Any] | None) -> "ReplicaStats | None":
        """None when the replica has published nothing yet."""
        return (stats or {}).get(ROUTING_STATS_KEY)
