"""The routing policy as a pure function: no Ray."""

from pagefleet.router.routing.policies import ReplicaLoad, rank_replicas, replica_load
from pagefleet.worker.metrics.stats import EngineStats, ReplicaStats


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


def test_pick_two_takes_the_less_loaded_of_two_random_replicas():
    import random

    from pagefleet.router.routing.policies import pick_two

    loads = [ReplicaLoad("a", num_running=5), ReplicaLoad("b", num_running=1), ReplicaLoad("c", num_running=3)]
    rng = random.Random(0)
    draws = [pick_two(loads, rng) for _ in range(200)]
    assert {tuple(d) for d in draws} == {("b", "a"), ("b", "c"), ("c", "a")}  # always the lighter one first
    equal = [ReplicaLoad("x"), ReplicaLoad("y")]
    assert {pick_two(equal, rng)[0] for _ in range(50)} == {"x", "y"}  # a tie goes either way
    assert pick_two([ReplicaLoad("only")], rng) == ["only"] and pick_two([], rng) == []


def test_round_robin_turns_through_replicas_in_id_order():
    from pagefleet.router.routing.policies import round_robin

    assert [round_robin(["c", "a", "b"], t)[0] for t in range(5)] == ["a", "b", "c", "a", "b"]
    assert round_robin(["c", "a", "b"], 2) == ["c", "a", "b"] and round_robin([], 3) == []


def test_prefix_table_follows_what_it_sent_until_the_owner_is_too_busy():
    from pagefleet.router.routing.prefix_table import PrefixTable

    table = PrefixTable(capacity=4, balance_slack=2)
    table.record([b"h1", b"h2", b"h3"], "b")
    loads = [ReplicaLoad("a"), ReplicaLoad("b", num_running=2)]
    assert table.longest_match([b"h1", b"h2", b"x"]) == ("b", 2)
    assert table.rank([b"h1", b"h2"], loads) == (["b", "a"], "cached_prefix")  # b is 2 busier: within the slack
    busy = [ReplicaLoad("a"), ReplicaLoad("b", num_running=3)]
    assert table.rank([b"h1"], busy) == (["a", "b"], "balance")  # 3 busier: balance instead
    assert table.rank([b"zz"], loads) == (["a", "b"], "no_match")  # nothing remembered: least loaded
    table.record([b"h4", b"h5"], "a")  # capacity 4: h1 is forgotten (least recently sent)
    assert table.longest_match([b"h1"]) == (None, 0) and len(table) == 4
    table.forget_replica("a")
    assert table.longest_match([b"h4"]) == (None, 0) and table.longest_match([b"h2"]) == ("b", 1)


def test_tiers_follow_the_ranking_then_the_rest_together():
    from types import SimpleNamespace

    from pagefleet.router.routing.request_router import _PagefleetRouter

    reps = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=i)) for i in ("a", "b", "c", "d")]
    tiers = _PagefleetRouter.tiers(reps, ["c", "gone", "a", "c"])  # unknown and repeated ids are skipped
    assert [[r.replica_id.unique_id for r in t] for t in tiers] == [["c"], ["a"], ["b", "d"]]
    assert [[r.replica_id.unique_id for r in t] for t in _PagefleetRouter.tiers(reps[:2], ["b", "a"])] == [["b"], ["a"]]
