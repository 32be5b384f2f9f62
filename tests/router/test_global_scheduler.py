"""The global scheduler's core on constructed states: exact choices, no Ray, no torch."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.kv_index import KVBlockIndex, routing_keys
from pagefleet.router.global_scheduler.kv_index_native import new_kv_index
from pagefleet.router.global_scheduler.views import RouteRequest
from pagefleet.worker.core.block_hash import block_hashes, extra_keys_digest, pack_hashes
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot

pytestmark = pytest.mark.usefixtures("kv_index_kind")

BS = 4
PROMPT = list(range(100, 117))  # 4 full blocks + 1 token


def hashes(tokens, salt=None):
    return block_hashes(tokens, BS, extra_keys_digest(() if salt is None else (salt,)))


def batch(worker, seq, stored=(), removed=(), *, first_seq=None, cleared=False, free=100, total=100,
          running=0, waiting=0, reserved=0, added=(), acquired=(), released=()):
    return KVEventBatch(worker, seq if first_seq is None else first_seq, seq, cleared, pack_hashes(stored),
                        pack_hashes([b"\0" * 16] * len(stored)), bytes(4 * BS * len(stored)), pack_hashes(removed),
                        free, total, running, waiting, reserved, list(added), pack_hashes(acquired),
                        pack_hashes(released))


def request(rid="r", tokens=PROMPT, num_blocks=6, salt=None):
    return RouteRequest(rid, pack_hashes(hashes(tokens, salt)), num_blocks)


def scheduler(**kw):
    kw.setdefault("weight", 4.0)
    return GlobalScheduler(**kw)


def test_equal_workers_tie_break_by_id_and_the_prediction_spreads_a_burst():
    gs = scheduler()
    for w in ("b", "a", "c"):
        gs.apply_batch(batch(w, 0), now=0.0)
    d = gs.route(request("r1"), now=0.0)
    assert d.ranking == ["a", "b", "c"] and d.admitted and d.reason == "load" and d.predicted_hit_blocks == 0
    assert [s.cost for s in d.scores] == [16.0, 16.0, 16.0]  # weight 4 x 4 prompt blocks, no load
    # r1's 6 blocks now count on a, and a is predicted to hold r1's prompt: a different
    # prompt goes elsewhere, the same prompt stays with a (4 x 0 + 6 < 4 x 4 + 0)
    other = gs.route(request("r2", tokens=list(range(500, 517))), now=0.1)
    assert other.ranking[0] == "b" and other.scores[-1].load_blocks == 6
    same = gs.route(request("r3"), now=0.2)
    assert same.ranking[0] == "a" and same.reason == "prefix" and same.predicted_hit_blocks == 4
    assert gs.workers["a"].predicted_blocks == 6 + 2  # r3 needs only 6 - 4 cached new blocks


def test_cached_prefix_wins_until_load_outweighs_it():
    gs = scheduler()
    h = hashes(PROMPT)
    gs.apply_batch(batch("a", 0), now=0.0)
    gs.apply_batch(batch("b", 0, stored=h[:3], free=80), now=0.0)  # b holds 3 of the 4 prompt blocks, 20 used
    d = gs.route(request(), now=0.0)
    # a: 4 x 4 + 0 = 16; b: 4 x 1 + 20 = 24 -> a, despite b's prefix
    assert d.ranking == ["a", "b"] and [s.cost for s in d.scores] == [16.0, 24.0]
    gs2 = scheduler()
    gs2.apply_batch(batch("a", 0), now=0.0)
    gs2.apply_batch(batch("b", 0, stored=h[:3], free=95), now=0.0)  # 5 used: 4 + 5 = 9 < 16
    d2 = gs2.route(request(), now=0.0)
    assert d2.ranking == ["b", "a"] and d2.reason == "prefix" and d2.predicted_hit_blocks == 3
    assert [s.cost for s in d2.scores] == [9.0, 16.0]


def test_only_the_leading_run_counts_as_cached():
    gs = scheduler()
    h = hashes(PROMPT)
    gs.apply_batch(batch("a", 0, stored=[h[0], h[2], h[3]]), now=0.0)  # a hole at block 1
    gs.apply_batch(batch("b", 0, stored=h[:2]), now=0.0)
    d = gs.route(request(), now=0.0)
    assert [(s.worker_id, s.cached_blocks) for s in d.scores] == [("b", 2), ("a", 1)]


def test_reserved_blocks_count_as_load_and_against_room():
    gs = scheduler()
    gs.apply_batch(batch("a", 0, free=50, reserved=45), now=0.0)  # room 5: a 6-block request does not fit
    gs.apply_batch(batch("b", 0, free=10, reserved=0), now=0.0)  # room 10, but 90 blocks in use
    d = gs.route(request(num_blocks=6), now=0.0)
    assert d.ranking == ["b"] and d.admitted  # a (load 50 used + 45 reserved) has no room: skipped
    assert [s.load_blocks for s in d.scores] == [90]


def test_no_worker_with_room_is_not_admitted_and_predicts_nothing():
    gs = scheduler()
    gs.apply_batch(batch("a", 0, free=3), now=0.0)
    gs.apply_batch(batch("b", 0, free=5, stored=hashes(PROMPT)[:1]), now=0.0)
    d = gs.route(request(num_blocks=8), now=0.0)
    # b: needs 8 - 1 cached = 7 > 5; a: 8 > 3. Ranked all the same, by cost:
    # b: 4 x 3 + 95 = 107, a: 4 x 4 + 97 = 113
    assert (d.admitted, d.reason, d.ranking) == (False, "no_room", ["b", "a"])
    assert gs.workers["b"].predicted_blocks == 0 and gs.counters.decisions_without_room == 1
    forced = gs.route(request(num_blocks=8), now=0.0, force=True)  # admission control off: route anyway
    assert forced.ranking[0] == "b" and gs.workers["b"].predicted_blocks == 7


def test_a_holder_without_room_but_with_a_seat_ranks_to_wait_when_that_costs_less():
    """The request needs 6 blocks; a holds its prompt's 4 (in use: shared) with no block free, c
    holds 1 with room, b none with room. a's cost 4 x 0 + its load ranks beside b's 4 x 4 + 0 and
    c's 4 x 3 + 50: with a load of 10 it comes first, to wait there for room; with 100 it comes
    last; without a seat it does not rank."""
    h = hashes(PROMPT)
    for total, expected in ((10, [("a", False), ("b", True), ("c", True)]),
                            (100, [("b", True), ("c", True), ("a", False)])):
        gs = scheduler()
        gs.apply_batch(batch("a", 0, stored=h, acquired=h, free=0, total=total, running=1), now=0.0)
        gs.apply_batch(batch("b", 0), now=0.0)
        gs.apply_batch(batch("c", 0, stored=h[:1], acquired=h[:1], free=50), now=0.0)
        d = gs.route(request(), now=0.0)
        assert [(s.worker_id, s.has_room) for s in d.scores] == expected
        assert [s.cost for s in d.scores] == sorted(s.cost for s in d.scores)
        assert d.admitted and d.reason == ("prefix" if expected[0][0] != "b" else "load")
        assert gs.counters.decisions_to_wait == (expected[0][0] == "a")
        first = gs.workers[expected[0][0]]
        assert first.predicted_blocks == 6 - {"a": 4, "b": 0}[first.worker_id] and first.predicted_seqs == 1
    gs = scheduler(max_seqs_per_worker=1)  # a's one seat is taken
    gs.apply_batch(batch("a", 0, stored=h, acquired=h, free=0, total=10, running=1), now=0.0)
    gs.apply_batch(batch("b", 0), now=0.0)
    d = gs.route(request(), now=0.0)
    assert [(s.worker_id, s.has_room) for s in d.scores] == [("b", True)] and gs.counters.decisions_to_wait == 0


def test_a_holder_without_room_waits_only_where_it_holds_more_than_the_best_worker_with_room():
    """b holds the whole prompt and has room: a, holding 2 of its 4 blocks without room, is not
    ranked to wait, however light its load (waiting there would compute more, not less)."""
    h = hashes(PROMPT)
    gs = scheduler()
    gs.apply_batch(batch("a", 0, stored=h[:2], acquired=h[:2], free=0, total=3, running=1), now=0.0)
    gs.apply_batch(batch("b", 0, stored=h, acquired=h, free=60), now=0.0)
    d = gs.route(request(), now=0.0)
    assert [(s.worker_id, s.has_room) for s in d.scores] == [("b", True)]


def test_prediction_ends_when_the_worker_reports_the_request_and_its_prefix_after_the_hold():
    gs = scheduler(prediction_ttl_s=2.0, prefix_hold_s=5.0)
    gs.apply_batch(batch("a", 0), now=0.0)
    gs.route(request("r1", num_blocks=6), now=0.0)
    assert gs.workers["a"].predicted_blocks == 6
    gs.apply_batch(batch("a", 1, free=94, reserved=2, added=["r1"]), now=0.5)  # took it in: 4 held, 2 to come
    assert gs.workers["a"].predicted_blocks == 0 and gs.workers["a"].load_blocks == 8
    assert gs.counters.predictions_confirmed == 1
    # the predicted prefix entries stay while a computes the prompt, past the ttl, so a twin
    # still goes to a ...
    assert gs.route(request("r2"), now=1.0, candidates=["a"]).predicted_hit_blocks == 4
    gs.apply_batch(batch("a", 2), now=2.9)
    assert gs.route(request("r3"), now=3.1, candidates=["a"]).predicted_hit_blocks == 4
    assert gs.counters.predictions_expired == 1  # r2 at 3.0, never reported (r1's was confirmed)
    # ... and are gone after the hold (a never stored the blocks: say r1 was aborted)
    assert gs.route(request("r4"), now=5.6, candidates=["a"]).predicted_hit_blocks == 0


def test_a_request_that_ends_before_its_worker_reports_it_gives_its_room_back_at_once():
    gs = scheduler(prediction_ttl_s=2.0, prefix_hold_s=5.0)
    gs.apply_batch(batch("a", 0, free=10, total=10), now=0.0)
    gs.route(request("r1", num_blocks=6), now=0.0)
    gs.route(request("r2", tokens=list(range(300, 317)), num_blocks=4), now=0.0)
    assert (gs.workers["a"].predicted_blocks, gs.workers["a"].predicted_seqs) == (10, 2)
    gs.apply_batch(batch("a", 1, free=6, total=10, reserved=2, added=["r1"]), now=0.1)  # r1 taken in
    gs.withdraw("r2")  # its client went away before a took it in: its 4 blocks and its seat are free now
    assert (gs.workers["a"].predicted_blocks, gs.workers["a"].predicted_seqs) == (0, 0)
    assert "r2" not in gs.predictions.by_request
    gs.withdraw("r1")  # confirmed: a's own counts carry it; its prefix hold stays
    assert gs.route(request("r3"), now=0.2, candidates=["a"]).predicted_hit_blocks == 4
    gs.withdraw("unknown")
    assert (gs.counters.predictions_withdrawn, gs.counters.predictions_confirmed) == (1, 1)


def test_a_prefix_still_computing_after_the_ttl_keeps_its_tenant_on_its_worker():
    gs = scheduler(prediction_ttl_s=2.0, prefix_hold_s=10.0)
    for w in ("a", "b", "c"):
        gs.apply_batch(batch(w, 0), now=0.0)
    assert gs.route(request("r1"), now=0.0).ranking[0] == "a"
    # a took r1 in but has stored none of its blocks yet (a long prompt, computing)
    gs.apply_batch(batch("a", 1, free=94, running=1, added=["r1"]), now=0.3)
    later = gs.route(request("r2"), now=2.5)
    # a: 4 x 0 + 6 in use = 6 beats an idle worker's 4 x 4 = 16
    assert later.ranking[0] == "a" and later.reason == "prefix" and later.predicted_hit_blocks == 4
    assert [s.cost for s in later.scores][:2] == [6.0, 16.0]


def test_the_prefix_hold_cannot_end_before_the_ttl():
    with pytest.raises(ValueError, match="prefix_hold_s"):
        scheduler(prediction_ttl_s=2.0, prefix_hold_s=1.0)


def test_a_sequence_gap_is_answered_by_a_snapshot():
    gs = scheduler(snapshot_retry_s=2.0)
    h = hashes(PROMPT)
    assert gs.apply_batch(batch("a", 0, stored=h[:2]), now=0.0) is False
    assert gs.apply_batch(batch("a", 2, stored=h[2:3]), now=0.1) is True  # batch 1 never came
    assert gs.counters.gaps == 1 and gs.counters.snapshots_asked == 1
    assert gs.apply_batch(batch("a", 3, removed=h[:1], free=7), now=0.2) is False  # asked already: wait
    assert gs.keys_of("a") == set(routing_keys(pack_hashes(h[:2])))  # nothing applied while unsynced
    assert gs.workers["a"].num_free_blocks == 7  # but counters are absolute: they are taken
    assert gs.apply_batch(batch("a", 4), now=2.5) is True  # still no snapshot after the retry time: ask again
    gs.apply_snapshot(KVSnapshot("a", 5, pack_hashes(h[1:4]), 60, 100, 1, 0, 0), now=2.6)
    assert gs.keys_of("a") == set(routing_keys(pack_hashes(h[1:4])))
    assert gs.apply_batch(batch("a", 5, stored=h[:1]), now=2.7) is False  # from before the snapshot
    assert gs.counters.stale_batches == 1 and gs.keys_of("a") == set(routing_keys(pack_hashes(h[1:4])))
    assert gs.apply_batch(batch("a", 6, stored=h[:1], removed=h[3:4]), now=2.8) is False
    assert gs.keys_of("a") == set(routing_keys(pack_hashes(h[:3])))
    merged = batch("a", 9, first_seq=7, removed=h[:1])  # a publisher's merge of 7..9 follows on
    assert gs.apply_batch(merged, now=2.9) is False and gs.workers["a"].seq == 9


def test_a_restarted_scheduler_asks_every_worker_for_a_snapshot():
    gs = scheduler()
    assert gs.apply_batch(batch("a", 41), now=0.0) is True  # mid-stream: it cannot know a's blocks
    assert gs.apply_batch(batch("b", 0), now=0.0) is False  # a fresh worker starts at 0, empty
    gs.apply_snapshot(KVSnapshot("a", 42, pack_hashes(hashes(PROMPT)), 90, 100, 0, 0, 0), now=0.1)
    assert gs.route(request(), now=0.2).ranking[0] == "a"


def test_dead_or_silent_workers_are_dropped_with_their_blocks():
    gs = scheduler(liveness_timeout_s=10.0)
    h = hashes(PROMPT)
    gs.apply_batch(batch("a", 0, stored=h), now=0.0)
    gs.apply_batch(batch("b", 0, stored=h[:1]), now=0.0)
    assert gs.drop_worker("a") is True and gs.drop_worker("a") is False
    assert gs.keys_of("a") is None and len(gs.index) == 1
    d = gs.route(request(), now=1.0)
    assert d.ranking == ["b"] and d.predicted_hit_blocks == 1
    gs.apply_batch(batch("c", 0, stored=h), now=5.0)  # reuses a's slot, holding only its own blocks
    assert gs.workers["c"].slot == 0 and gs.keys_of("c") == set(routing_keys(pack_hashes(h)))
    gs.expire(now=12.0)  # b silent since 0.0; c seen at 5.0
    assert sorted(gs.workers) == ["c"] and gs.counters.workers_dropped == 2


def test_two_salts_never_share_or_probe_each_other():
    gs = scheduler()
    gs.apply_batch(batch("a", 0, stored=hashes(PROMPT, salt="tenant-1")), now=0.0)
    gs.apply_batch(batch("b", 0), now=0.0)
    assert gs.route(request("r1", salt="tenant-1"), now=0.0).predicted_hit_blocks == 4
    other = gs.route(request("r2", salt="tenant-2"), now=0.0, candidates=["a"])
    assert other.predicted_hit_blocks == 0 and other.reason == "load"
    unsalted = gs.route(request("r3"), now=0.0, candidates=["a"])
    assert unsalted.predicted_hit_blocks == 0
    assert set(hashes(PROMPT, "tenant-1")).isdisjoint(hashes(PROMPT, "tenant-2"))


def test_candidates_limit_the_ranking_and_unknown_ones_start_empty():
    gs = scheduler()
    gs.apply_batch(batch("a", 0, stored=hashes(PROMPT)), now=0.0)
    d = gs.route(request(), now=0.0, candidates=["new"])
    assert d.ranking == ["new"] and d.admitted  # nothing known of it yet: it may take the request
    assert gs.route(RouteRequest("x", b"", 1), now=0.0, candidates=[]).reason == "no_workers"


def test_an_idle_cached_prefix_counts_against_room_and_one_in_use_does_not():
    gs = scheduler()
    h = hashes(PROMPT)
    # a holds the prompt's 4 blocks with 5 of 10 free; the request takes 6 blocks, 2 of them new
    # (a's cost 4 x 0 + 5 used beats b's 4 x 4 + 0 whenever a has room)
    gs.apply_batch(batch("a", 0, stored=h, free=5, total=10), now=0.0)
    gs.apply_batch(batch("b", 0), now=0.0)
    assert gs.in_use_of("a") == set(routing_keys(pack_hashes(h)))  # stored: a running sequence holds them
    assert gs.route(request("r1"), now=0.0).ranking[0] == "a"  # shared: 2 new blocks <= 5
    gs.expire(10.0)  # r1's prediction ends
    gs.apply_batch(batch("a", 1, free=5, total=10, released=h), now=10.0)  # now idle: reusing them takes 4 more
    d = gs.route(request("r2"), now=10.0)
    # a has no room for 2 + 4; it still ranks first, to wait there (its cost 5 against b's 16)
    assert [(s.worker_id, s.has_room) for s in d.scores] == [("a", False), ("b", True)] and d.admitted
    gs.expire(20.0)
    gs.apply_batch(batch("a", 2, free=5, total=10, acquired=h[:3]), now=20.0)  # 3 in use again, the 4th idle
    d = gs.route(request("r3"), now=20.0)
    assert d.ranking[0] == "a" and gs.workers["a"].predicted_blocks == 2 + 1  # 2 new + the idle 4th


def test_a_routed_request_takes_the_idle_prefix_so_the_next_one_shares_it():
    gs = scheduler()
    h = hashes(PROMPT)
    gs.apply_batch(batch("a", 0, stored=h, free=12, released=h), now=0.0)  # 4 idle cached blocks
    assert gs.in_use_of("a") == set()
    first = gs.route(request("r1"), now=0.0)
    assert first.ranking[0] == "a" and gs.workers["a"].predicted_blocks == 6  # 2 new + 4 idle
    # r1 will hold the prefix: r2 shares it, and needs room for its 2 new blocks only (12 - 6 >= 2)
    second = gs.route(request("r2"), now=0.1)
    assert second.ranking[0] == "a" and gs.workers["a"].predicted_blocks == 6 + 2
    # r1 starts: its blocks leave the prediction, the worker's events say the prefix is in use
    gs.apply_batch(batch("a", 1, free=4, added=["r1"], acquired=h), now=0.2)
    assert gs.workers["a"].predicted_blocks == 2 and gs.predictions._soon_in_use[gs.workers["a"].slot] == {}
    assert gs.workers["a"].room_blocks == 4 - 2


def test_a_shared_prefix_that_goes_idle_before_the_request_starts_counts_against_room():
    # r1 is routed to share a prefix a running request holds; that request ends before r1 starts,
    # so r1 will take the 4 prefix blocks out of the free count after all: counted from the batch
    # that says so, once (r2 routed behind r1 shares them again), until the worker takes r1 in.
    gs = scheduler()
    h = hashes(PROMPT)
    gs.apply_batch(batch("a", 0, stored=h, free=12), now=0.0)  # in use by a running request
    gs.route(request("r1"), now=0.0)
    gs.route(request("r2"), now=0.0)
    assert gs.workers["a"].predicted_blocks == 2 + 2  # each computes 2 new blocks, sharing the prefix
    gs.apply_batch(batch("a", 1, free=12, released=h[:3]), now=0.1)  # its holder ended: 3 of 4 now idle
    view = gs.workers["a"]
    assert view.predicted_blocks == 2 + 2 + 3 and view.room_blocks == 12 - 7
    idle, _ = gs.predictions.cached_keys(view, routing_keys(pack_hashes(h)), 4, gs.index)
    assert idle == []  # taken by r1: nobody counts them idle
    gs.apply_batch(batch("a", 2, free=12, removed=h[3:]), now=0.2)  # the 4th evicted: computed again
    assert view.predicted_blocks == 2 + 2 + 4
    gs.apply_batch(batch("a", 3, free=6, added=["r1", "r2"], acquired=h[:3]), now=0.3)  # both taken in
    assert view.predicted_blocks == 0
    assert gs.predictions._sharing[view.slot] == {} and gs.predictions._soon_in_use[view.slot] == {}


def test_a_shared_prefix_still_in_use_costs_nothing_until_the_request_starts():
    gs = scheduler()
    h = hashes(PROMPT)
    gs.apply_batch(batch("a", 0, stored=h, free=12), now=0.0)
    gs.route(request("r1"), now=0.0)
    # the 4th evicted and computed again by another request in one batch: in use, still shared
    gs.apply_batch(batch("a", 1, free=12, removed=h[3:], stored=h[3:]), now=0.1)
    gs.apply_batch(batch("a", 2, free=12, stored=hashes(list(range(500, 508)))), now=0.15)
    assert gs.workers["a"].predicted_blocks == 2
    gs.apply_batch(batch("a", 3, free=10, added=["r1"]), now=0.2)
    assert gs.workers["a"].predicted_blocks == 0 and gs.predictions._sharing[gs.workers["a"].slot] == {}


def test_a_prefix_only_predicted_there_is_not_shared_with_its_holders():
    # r1 will compute the prompt on a, r2 is routed behind it to share what r1 computes: an idle
    # block released meanwhile (someone else's) takes nothing from r2's count
    gs = scheduler()
    gs.apply_batch(batch("a", 0, free=50), now=0.0)
    gs.apply_batch(batch("b", 0, free=50), now=0.0)
    assert gs.route(request("r1"), now=0.0).ranking[0] == "a"
    second = gs.route(request("r2"), now=0.0)
    assert second.ranking[0] == "a" and second.predicted_hit_blocks == 4
    other = hashes(list(range(500, 508)))
    gs.apply_batch(batch("a", 1, free=50, stored=other), now=0.1)
    gs.apply_batch(batch("a", 2, free=50, released=other), now=0.2)
    assert gs.workers["a"].predicted_blocks == 6 + 2 and gs.predictions._sharing.get(gs.workers["a"].slot, {}) == {}


def test_a_worker_without_a_seat_has_no_room_and_confirmed_requests_move_from_predicted_to_queued():
    gs = scheduler(max_seqs_per_worker=4)
    gs.apply_batch(batch("a", 0, running=2, waiting=1), now=0.0)  # 3 of its 4 seats taken
    gs.apply_batch(batch("b", 0, free=40, running=1), now=0.0)  # fewer blocks free, more seats
    d = gs.route(request("r1"), now=0.0)
    assert d.ranking[0] == "a" and gs.workers["a"].seats == 0  # cheaper (load), the last seat
    d = gs.route(request("r2"), now=0.0)
    assert d.admitted and d.ranking == ["b"]  # a is full: only b ranks
    assert gs.route(RouteRequest("r3", b"", 1, num_seqs=3), now=0.0).admitted is False  # b has 2 seats left
    gs.apply_batch(batch("a", 1, running=3, waiting=1, added=["r1"]), now=0.1)  # r1 taken in: queued, not predicted
    assert (gs.workers["a"].predicted_seqs, gs.workers["a"].queued, gs.workers["a"].seats) == (0, 4, 0)
    gs.apply_batch(batch("a", 2, running=2, waiting=0), now=0.2)  # two finished
    assert gs.route(RouteRequest("r4", b"", 1, num_seqs=2), now=0.2).ranking[0] == "a"


def test_snapshots_and_restored_copies_carry_what_is_in_use():
    gs = scheduler()
    h = hashes(PROMPT)
    gs.apply_batch(batch("a", 0, stored=h), now=0.0)
    gs.apply_batch(batch("a", 3, first_seq=3, released=h), now=0.1)  # a gap: the view waits for a snapshot
    gs.apply_snapshot(KVSnapshot("a", 3, pack_hashes(h), 90, 100, 1, 0, 0, [], pack_hashes(h[:1])), now=0.2)
    keys = routing_keys(pack_hashes(h))
    assert gs.in_use_of("a") == {keys[0]}
    copy = scheduler()
    copy.restore(gs.worker_states(), now=0.3)
    assert copy.in_use_of("a") == {keys[0]} and copy.keys_of("a") == set(keys)


def test_index_holder_encoding_round_trips():
    index = new_kv_index()
    index.add(3, [10, 11])
    index.add(300, [11, 12])  # a slot beyond the small-int range
    index.add(3, [10])  # twice: no change
    assert (index.holders(10), index.holders(11), index.holders(12)) == (1 << 3, 1 << 3 | 1 << 300, 1 << 300)
    assert index.prefix_runs([10, 11, 12]) == {2: 1 << 3}
    assert index.prefix_runs([11, 12]) == {1: 1 << 3, 2: 1 << 300}
    assert index.prefix_runs([11, 12], extra={12: 3}) == {2: 1 << 3 | 1 << 300}  # a predicted holder extends the run
    assert index.prefix_runs([12]) == {1: 1 << 300} and index.prefix_runs([99, 10]) == {} and index.prefix_runs([]) == {}
    index.remove(300, [11, 99])
    assert index.holders(11) == 1 << 3
    if isinstance(index, KVBlockIndex):
        assert index._holders[11] == 3  # back to the single-holder form
    index.replace(3, [11, 13])
    assert index.keys_of(3) == {11, 13} and index.holders(10) == 0 and len(index) == 3
    index.clear(300)
    assert index.num_entries() == 2 and index.holders(12) == 0
    with pytest.raises(ValueError):
        routing_keys(b"short")
    assert routing_keys(bytes(range(16))) == [int.from_bytes(bytes(range(8)), "little")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "clear", "replace"]), st.sampled_from([0, 1, 7, 256, 300]),
                          st.lists(st.integers(0, 12), max_size=6)), max_size=40))
def test_index_equals_a_plain_model(ops):
    index, model = new_kv_index(), {}
    for op, slot, keys in ops:
        mine = model.setdefault(slot, set())
        if op == "add":
            index.add(slot, keys)
            mine.update(keys)
        elif op == "remove":
            index.remove(slot, keys)
            mine.difference_update(keys)
        elif op == "clear":
            index.clear(slot)
            mine.clear()
        else:
            index.replace(slot, keys)
            model[slot] = set(keys)
    for key in range(13):
        expected = sum(1 << slot for slot, keys in model.items() if key in keys)
        assert index.holders(key) == expected
        assert all(index.holds(slot, key) == (key in keys) for slot, keys in model.items())
    for slot, keys in model.items():
        assert index.keys_of(slot) == keys
    assert len(index) == len(set().union(*model.values())) if model else len(index) == 0
    probe = [0, 1, 2, 3]
    expected_runs = {}
    for slot, keys in model.items():
        run = next((i for i, k in enumerate(probe) if k not in keys), len(probe))
        if run:
            expected_runs[run] = expected_runs.get(run, 0) | 1 << slot
    assert index.prefix_runs(probe) == expected_runs


def reference_ranking(gs, req, max_ranked, candidates=None):
    """route's ranking by its definition, worker by worker: no early stop, no grouping."""
    keys = routing_keys(req.block_hashes)
    views = gs.workers.values() if candidates is None else [gs.workers[c] for c in dict.fromkeys(candidates)]
    rows = []
    for v in views:
        cached = 0
        while cached < len(keys) and (gs.index.holds(v.slot, keys[cached])
                                      or gs.predictions.holders(keys[cached]) >> v.slot & 1):
            cached += 1
        idle = gs.predictions.cached_keys(v, keys, cached, gs.index)[0]
        seat = v.seats >= req.num_seqs
        full = not seat or v.room_blocks < req.num_blocks - cached + len(idle)  # unreported: no bound
        rows.append(((full, gs.weight * (len(keys) - cached) + v.load_blocks, v.load_blocks, v.queued, v.worker_id,
                      cached), seat))
    with_room = sorted(row for row, _ in rows if not row[0])
    if not with_room:
        return [(row[4], row[5], False) for row in sorted(row for row, _ in rows)[:max_ranked]]
    # Workers holding more of the prompt than the best one with room, without room but with a
    # seat, rank beside those with room: the request can wait there.
    waiting = [(False, *row[1:]) for row, seat in rows if row[0] and seat and row[5] > with_room[0][5]]
    best = sorted(with_room + waiting)[:max_ranked]
    return [(row[4], row[5], row in with_room) for row in best]


@pytest.mark.parametrize("seed", range(40))
def test_route_ranks_as_its_definition_on_random_states(seed):
    """route walks the workers least loaded first and stops early; on random fleets (prefixes held
    and predicted, tight rooms and seats, ties, slots past 64, predictions expiring, candidate lists
    with repeats and workers not heard from) its ranking equals one computed worker by worker."""
    import random

    rng = random.Random(seed)
    max_ranked = rng.choice([1, 2, 3, 8])
    gs = scheduler(max_ranked=max_ranked, max_seqs_per_worker=rng.choice([None, 2, 4]), liveness_timeout_s=1e9,
                   prediction_ttl_s=rng.choice([0.25, 2.0]))
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(4, 33))] for _ in range(6)]
    prompts += [prompts[0][:8] + [rng.randrange(1000) for _ in range(8)]]  # shares a prefix with the first
    chains = [hashes(p) for p in prompts]
    num_workers = rng.randrange(1, 13) if seed % 4 else rng.randrange(65, 90) if seed % 8 else rng.randrange(250, 300)
    for w in range(num_workers):
        held = [h for chain in rng.sample(chains, rng.randrange(0, 3)) for h in chain[:rng.randrange(len(chain) + 1)]]
        total = rng.choice([40, 60, 100])
        free = rng.randrange(0, total + 1)
        gs.apply_batch(batch(f"w{w:02d}", 0, stored=held, free=free, total=total, running=rng.randrange(3),
                             waiting=rng.randrange(2), reserved=rng.randrange(0, 10),
                             acquired=held[:rng.randrange(len(held) + 1)]), now=0.0)
    now = 0.0
    for i in range(12):
        now += 0.1
        p = rng.randrange(len(prompts))
        req = RouteRequest(f"r{i}", pack_hashes(chains[p]), num_blocks=len(chains[p]) + rng.randrange(0, 20),
                           num_seqs=rng.choice([1, 1, 2]))
        candidates = None
        if rng.random() < 0.3:  # a subset, a repeat, and a worker never heard from (no room figure yet)
            candidates = rng.sample(sorted(gs.workers), rng.randrange(1, len(gs.workers) + 1))
            candidates += candidates[:1] + [f"new{i}"]
            gs._view(f"new{i}", now)  # what route does with it: an empty view
        gs.expire(now)
        expected = reference_ranking(gs, req, max_ranked, candidates)
        d = gs.route(req, now=now, candidates=candidates, force=rng.random() < 0.3)
        assert [(s.worker_id, s.cached_blocks, s.has_room) for s in d.scores] == expected


def test_a_repeated_candidate_is_ranked_once():
    """Candidates naming a worker twice rank as if it were named once: the repeat neither shows
    twice nor hides a better worker of its prefix group (a's row is seen and b still wins)."""
    gs = scheduler(max_ranked=1)
    h = hashes(list(range(8)))
    gs.apply_batch(batch("a", 0, stored=h[:1], free=0, total=10), now=0.0)  # the prefix, no room
    gs.apply_batch(batch("b", 0, stored=h[:1], free=50, total=100), now=0.0)  # the prefix, room, load 50
    gs.apply_batch(batch("c", 0, free=51, total=100), now=0.0)  # no prefix, load 49
    d = gs.route(RouteRequest("r", pack_hashes(h[:2]), num_blocks=4), now=0.0, candidates=["a", "a", "b", "c"])
    assert d.ranking == ["b"] and d.reason == "prefix" and d.scores[0].cost == 4.0 * 1 + 50


def test_a_cached_prefix_can_give_room_when_no_worker_has_a_whole_requests_blocks():
    """No worker's room covers the request's 6 blocks, but b holds 2 of them in use, so 4 new
    blocks fit its room of 4: the walk must not give up on b's group after its first row (a, full)."""
    gs = scheduler(max_ranked=1)
    h = hashes(list(range(8)))
    gs.apply_batch(batch("a", 0, stored=h, free=0, total=10), now=0.0)  # load 10, no room
    gs.apply_batch(batch("b", 0, stored=h, free=4, total=100), now=0.0)  # load 96, room 4
    gs.apply_batch(batch("c", 0, free=5, total=100), now=0.0)  # load 95, room 5 < 6
    d = gs.route(RouteRequest("r", pack_hashes(h), num_blocks=6), now=0.0)
    assert d.admitted and d.ranking == ["b"] and d.predicted_hit_blocks == 2


def test_an_error_counting_idle_blocks_comes_out_of_route():
    """Whether a has room depends on its idle cached blocks (room 5: 4 new blocks fit, 6 do not), so
    the walk asks for their count; a failure there is raised by route, not taken for an answer."""
    gs = scheduler()
    h = hashes(list(range(8)))
    gs.apply_batch(batch("a", 0, stored=h, released=h, free=5, total=100), now=0.0)

    def broken(*args):
        raise KeyError("the prediction bookkeeping broke")

    gs.predictions.cached_keys = broken
    with pytest.raises(KeyError, match="bookkeeping broke"):
        gs.route(RouteRequest("r", pack_hashes(h), num_blocks=6), now=0.0)


class BatchStream:
    """Random KV event batches of a few workers: churn, keys going in and out of use, clears, merged
    steps, lost batches (gaps), duplicates (stale), requests reported taken in; and the snapshots,
    prompts and drops to go between them."""

    WORKERS = ("w0", "w1", "w2", "w3", "w4")

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_key = 1000
        self.shared = [self.fresh(4) for _ in range(3)]  # prompt heads several workers store
        self.seq = {w: -1 for w in self.WORKERS}
        self.chains: dict[str, list[list[int]]] = {w: [] for w in self.WORKERS}  # what each caches, oldest first
        self.in_use: dict[str, set[int]] = {w: set() for w in self.WORKERS}
        self.sent: dict[str, list[KVEventBatch]] = {w: [] for w in self.WORKERS}
        self.routed: dict[str, list[str]] = {w: [] for w in self.WORKERS}  # requests routed there, not reported
        self.requests = 0

    def fresh(self, n: int) -> list[int]:
        self.next_key += n
        return list(range(self.next_key - n, self.next_key))

    def batch(self) -> KVEventBatch:
        rng = self.rng
        w = rng.choice(self.WORKERS)
        if self.sent[w] and rng.random() < 0.08:
            return rng.choice(self.sent[w])  # sent again
        chains, in_use = self.chains[w], self.in_use[w]
        first_seq = self.seq[w] + 1 + (rng.random() < 0.05)  # one lost on the way: a gap
        self.seq[w] = seq = first_seq + (rng.random() < 0.2)  # steps merged into one batch
        cleared = rng.random() < 0.03
        if cleared:
            chains.clear()
            in_use.clear()
        removed = [k for _ in range(rng.randrange(3)) if chains for k in chains.pop(0)]
        held = {k for c in chains for k in c}
        head = rng.choice(self.shared)
        stored = ([k for k in head if k not in held] if rng.random() < 0.5 else []) + self.fresh(rng.randrange(4))
        chains.append(stored)
        idle = sorted(held - in_use)
        acquired = rng.sample(idle, min(len(idle), rng.randrange(3)))
        in_use.difference_update(removed)
        in_use.update(stored + acquired)
        released = rng.sample(sorted(in_use), min(len(in_use), rng.randrange(4)))
        in_use.difference_update(released)
        routed = self.routed[w]
        added = [routed.pop(0) for _ in range(min(len(routed), rng.randrange(3)))] + ["unknown"] * (rng.random() < 0.1)
        b = batch(w, seq, [h(k) for k in stored], [h(k) for k in removed], first_seq=first_seq, cleared=cleared,
                  free=rng.randrange(10, 60), total=64, running=rng.randrange(5), waiting=rng.randrange(3),
                  reserved=rng.randrange(8), added=added, acquired=[h(k) for k in acquired],
                  released=[h(k) for k in released])
        self.sent[w].append(b)
        return b

    def snapshot(self, w: str) -> KVSnapshot:
        held = [k for c in self.chains[w] for k in c]
        return KVSnapshot(w, self.seq[w], pack_hashes([h(k) for k in held]), 30, 64, 1, 0, 2,
                          in_use_hashes=pack_hashes([h(k) for k in sorted(self.in_use[w])]))

    def prompt(self) -> RouteRequest:
        rng = self.rng
        chains = self.chains[rng.choice(self.WORKERS)]
        head = rng.choice(self.shared) + (rng.choice(chains) if chains else [])
        self.requests += 1
        keys = head[: rng.randrange(len(head) + 1)] + self.fresh(rng.randrange(1, 3))
        return RouteRequest(f"r{self.requests}", pack_hashes([h(k) for k in keys]), len(keys) + 2)


def h(key: int) -> bytes:
    return key.to_bytes(8, "little") + b"\xa5" * 8


@pytest.mark.parametrize("seed", range(8))
def test_a_run_of_batches_applied_at_once_leaves_the_view_one_by_one_would(seed):
    """``apply_batches`` against ``apply_batch`` per batch over random streams: every worker's view
    and keys, the counters, the predictions and each decision equal."""
    stream = BatchStream(seed)
    one, many = scheduler(max_seqs_per_worker=6), scheduler(max_seqs_per_worker=6)
    rng, run, now = stream.rng, [], 0.0
    runs = sharing_mid_run = 0

    def flush():
        nonlocal runs, sharing_mid_run
        if not run:
            return
        sharing_mid_run += any(many.predictions.shares_on(many.workers[b.worker_id].slot)
                               for b in run[:-1] if b.worker_id in many.workers)
        asked = [b.worker_id for b in run if one.apply_batch(b, now)]
        assert many.apply_batches(run, now) == asked
        runs += 1
        run.clear()

    def assert_same():
        assert one.counters == many.counters
        assert one.workers == many.workers  # every field of every view (not the walk's table: a copy of them)
        for w in one.workers:
            assert (one.keys_of(w), one.in_use_of(w)) == (many.keys_of(w), many.in_use_of(w))
        assert one.predictions.by_request == many.predictions.by_request
        if one._table is not None:
            assert one._table.values == many._table.values

    for _ in range(400):
        now += 0.05
        if rng.random() < 0.7:
            run.append(stream.batch())
            continue
        flush()
        op = rng.random()
        if op < 0.5:
            req = stream.prompt()
            decision = one.route(req, now)
            assert many.route(req, now) == decision
            if decision.admitted:
                stream.routed[decision.ranking[0]].append(req.request_id)
        elif op < 0.85:
            for w in [w for w, v in one.workers.items() if not v.synced or rng.random() < 0.1]:
                one.apply_snapshot(stream.snapshot(w), now)
                many.apply_snapshot(stream.snapshot(w), now)
        elif op < 0.9:
            w = rng.choice(stream.WORKERS)
            assert one.drop_worker(w) == many.drop_worker(w)
        else:
            assert_same()
    flush()
    assert_same()
    c = one.counters
    assert min(c.gaps, c.stale_batches, c.snapshots_applied, c.predictions_confirmed, c.workers_dropped) > 0
    assert runs > 20 and c.batches > 100
    assert sharing_mid_run > 0  # runs where a prediction shares keys of a batch before the last
