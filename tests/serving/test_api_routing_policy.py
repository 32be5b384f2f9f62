"""The routing policy as a pure function: no Ray."""

from pagefleet.router.routing_policy import ReplicaLoad, rank_replicas, replica_load
from pagefleet.worker.stats import EngineStats, ReplicaStats


def test_fewest_queued_sequences_first():
    loads = [ReplicaLoad("a", num_running=3, num_waiting=1), ReplicaLoad("b", num_running=1),
             ReplicaLoad("c", num_running=2, num_waiting=0)]
    assert rank_replicas(loads) == ["b", "c", "a"]


def test_ties_broken_by_free_blocks_then_id():
    loads = [ReplicaLoad("a", num_running=1, num_free_blocks=10), ReplicaLoad("b", num_running=1, num_free_blocks=50),
             ReplicaLoad("c", num_running=1, num_free_blocks=10)]
    assert rank_replicas(loads) == ["b", "a", "c"]


def test_in_flight_count_overrides_stale_stats():
    # b published "idle" but this router has just sent it 4 sequences
    loads = [ReplicaLoad("a", num_running=2), ReplicaLoad("b", num_running=0, num_in_flight=4)]
    assert rank_replicas(loads) == ["a", "b"]
    assert loads[1].num_queued == 4


def test_unhealthy_replicas_go_last():
    loads = [ReplicaLoad("a", healthy=False), ReplicaLoad("b", num_running=9, num_waiting=9)]
    assert rank_replicas(loads) == ["b", "a"]


def test_snapshot_from_published_stats():
    engine = EngineStats(num_total_blocks=9, num_free_blocks=7, num_running=2, num_waiting=1,
                         prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, num_steps=3,
                         prompt_tokens_total=0, generation_tokens_total=0)
    published = ReplicaStats("r1", healthy=False, num_requests_total=4, engine=engine).to_routing_stats()
    assert replica_load("r1", ReplicaStats.from_routing_stats(published), 5) == ReplicaLoad("r1", 2, 1, 7, 9, 5, False)
    # A replica that has published nothing yet counts as empty and healthy (and says it has no stats).
    assert ReplicaStats.from_routing_stats({}) is None
    assert replica_load("r2", ReplicaStats.from_routing_stats(None), 0) == ReplicaLoad("r2", published=False)
    assert rank_replicas([]) == []
