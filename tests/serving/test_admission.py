"""Admission control and the ingress's kv routing client (deciding with its copy of the view),
without Ray: exact orders and counts."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.router.admission import ERROR_MEMORY_S, AdmissionQueue, AdmissionRejected
from pagefleet.router.errors import OpenAIError
from pagefleet.router.global_scheduler import GlobalScheduler
from pagefleet.router.kv_mirror import SchedulerMirror
from pagefleet.router.kv_routing import (KVRoutingClient, KVRoutingOptions, admission_wait, request_blocks,
                                          route_by_inflight)
from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.view_feed import ViewFeed
from pagefleet.worker.kv_events import KVEventBatch


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


class Room:
    """Whether a worker has room, as the scheduler would answer; counts the questions."""

    def __init__(self) -> None:
        self.free = False
        self.asked: list[str] = []

    def attempt(self, name: str):
        async def ask() -> bool:
            self.asked.append(name)
            return self.free
        return ask


def test_admitted_at_once_when_nobody_waits_and_there_is_room():
    async def run():
        q, room = AdmissionQueue(max_size=2, max_wait_s=5.0), Room()
        room.free = True
        assert await q.admit(room.attempt("a"), bool) is True
        assert (room.asked, q.counters.admitted_at_once, len(q)) == (["a"], 1, 0)

    asyncio.run(run())


def test_waiters_are_admitted_first_come_first_served_and_only_the_head_asks():
    async def run():
        q, room = AdmissionQueue(max_size=3, max_wait_s=5.0, retry_s=0.001), Room()
        order: list[str] = []

        async def client(name: str) -> None:
            await q.admit(room.attempt(name), bool)
            order.append(name)

        tasks = [asyncio.create_task(client(n)) for n in "abc"]
        while len(q) < 3:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        # a asked on arrival, then as the head again and again; b and c found a queue on
        # arrival, so they never asked
        assert set(room.asked) == {"a"} and len(room.asked) > 2
        room.free = True
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "c"]
        assert (q.counters.admitted_after_waiting, q.counters.longest_queue, len(q)) == (3, 3, 0)

    asyncio.run(run())


def test_a_full_queue_refuses_at_once():
    async def run():
        q, room = AdmissionQueue(max_size=1, max_wait_s=5.0, retry_s=0.001), Room()
        waiting = asyncio.create_task(q.admit(room.attempt("a"), bool))
        while len(q) < 1:
            await asyncio.sleep(0.001)
        with pytest.raises(AdmissionRejected, match="1 requests are already waiting") as info:
            await q.admit(room.attempt("b"), bool)
        assert info.value.retry_after_s == 5
        assert "b" not in room.asked and q.counters.rejected_queue_full == 1
        room.free = True
        assert await waiting is True

    asyncio.run(run())


def test_waiting_past_the_limit_is_refused_and_the_next_one_moves_up():
    async def run():
        now = [0.0]  # the queue's clock, moved by hand: no timing in this test
        q, room = AdmissionQueue(max_size=4, max_wait_s=0.3, retry_s=0.001, clock=lambda: now[0]), Room()
        first = asyncio.create_task(q.admit(room.attempt("a"), bool))
        await asyncio.sleep(0.01)
        now[0] = 0.2
        second = asyncio.create_task(q.admit(room.attempt("b"), bool))
        await asyncio.sleep(0.01)
        now[0] = 0.31  # a has waited 0.31 s, b 0.11 s
        with pytest.raises(AdmissionRejected, match="within 0.3 s"):
            await first
        room.free = True  # b, now the head, gets in on its next try
        assert await second is True
        assert "b" in room.asked
        assert (q.counters.rejected_waited_too_long, q.counters.admitted_after_waiting, len(q)) == (1, 1, 0)

    asyncio.run(run())


def test_request_blocks_share_full_prompt_blocks_between_sequences():
    # 40-token prompt, 24 more tokens, blocks of 16: each sequence ends at 64 tokens = 4 blocks;
    # the 2 full prompt blocks are shared, so each further sequence adds 2
    assert request_blocks(40, 24, 1, 16) == 4
    assert request_blocks(40, 24, 3, 16) == 4 + 2 * 2
    assert request_blocks(5, 1, 1, 16) == 1


def test_expected_wait_past_the_limit_refuses_on_arrival():
    async def run():
        now = [0.0]  # moved by hand: nobody's wait runs out
        q = AdmissionQueue(max_size=10, max_wait_s=1.0, retry_s=0.001, clock=lambda: now[0])
        allowed: set[str] = set()
        asked: list[str] = []

        def attempt(name):
            async def ask() -> bool:
                asked.append(name)
                return name in allowed
            return ask

        tasks = {n: asyncio.create_task(q.admit(attempt(n), bool)) for n in "abcd"}
        while len(q) < 4:
            await asyncio.sleep(0.001)
        assert q.estimated_wait() == (None, False)  # nothing has left the queue yet: no rate to go by
        for t, name in ((0.4, "a"), (0.8, "b")):  # a, then b, leave 0.4 s apart
            now[0] = t
            allowed.add(name)
            await tasks[name]
        # c and d wait; one interval seen (0.4 s): a newcomer would be third, 1.2 s > 1.0 s
        # (the rate rule is not counted double while unchecked)
        assert (len(q), q.departure_interval_s) == (2, pytest.approx(0.4))
        with pytest.raises(AdmissionRejected, match="about 1.2 s to admit") as info:
            q.check_room()
        assert info.value.reason == "expected_wait" and q.counters.rejected_expected_wait == 1
        with pytest.raises(AdmissionRejected):
            await q.admit(attempt("e"), bool)
        assert "e" not in asked and q.counters.rejected_expected_wait == 2
        allowed.update("cd")
        await asyncio.gather(*tasks.values())
        assert q.estimated_wait() == (None, False)  # an empty queue has no wait

    asyncio.run(run())


def test_an_estimate_decides_the_expected_wait_even_for_the_first_waiter():
    async def run():
        now = [0.0]
        seen: list[tuple[list, str]] = []

        def estimate(ahead, item):
            seen.append((list(ahead), item))
            return 0.4 * (len(ahead) + 1)  # each waiter ahead, and the newcomer, takes 0.4 s

        q = AdmissionQueue(max_size=10, max_wait_s=1.0, retry_s=0.001, clock=lambda: now[0], estimate=estimate)
        room = Room()
        first = asyncio.create_task(q.admit(room.attempt("a"), bool, "A"))
        while len(q) < 1:
            await asyncio.sleep(0.001)
        # second in line: 0.8 s, doubled while unchecked
        with pytest.raises(AdmissionRejected, match="about 1.6 s to admit") as info:
            await q.admit(room.attempt("b"), bool, "B")
        assert info.value.reason == "expected_wait" and "b" not in room.asked
        assert seen == [([], "A"), (["A"], "B")]  # a was estimated too, with nobody ahead (0.8 s: it waits)
        assert q.check_room() is None  # without an item (before the request is read): the queue's rate, unknown yet
        room.free = True
        assert await first is True

    asyncio.run(run())


def test_a_wait_longer_than_estimated_pads_the_estimates_after_it_for_a_while():
    async def run():
        now = [0.0]
        q = AdmissionQueue(max_size=10, max_wait_s=0.5, retry_s=0.001, clock=lambda: now[0],
                           estimate=lambda ahead, item: item)  # the item is the estimate
        room = Room()
        first = asyncio.create_task(q.admit(room.attempt("a"), bool, 0.2))  # unchecked: 0.4 s, it waits
        while len(q) < 1:
            await asyncio.sleep(0.001)
        now[0] = 0.45
        room.free = True
        assert await first is True  # estimated 0.2 s, waited 0.45 s: 0.25 s short
        assert q.shortfall_s() == pytest.approx(0.25)
        room.free = False
        with pytest.raises(AdmissionRejected, match="about 0.6 s to admit"):  # 0.35 + 0.25 > 0.5
            await q.admit(room.attempt("b"), bool, 0.35)
        second = asyncio.create_task(q.admit(room.attempt("c"), bool, 0.1))  # 0.35: it may wait
        while len(q) < 1:
            await asyncio.sleep(0.001)
        now[0] = 0.5
        room.free = True
        assert await second is True  # 0.05 s for an estimated 0.1: the 0.25 s shortfall still counts
        assert q.shortfall_s() == pytest.approx(0.25)
        now[0] = 0.5 + ERROR_MEMORY_S + 0.01  # both checks are forgotten: estimates count double again
        assert q.shortfall_s() is None
        room.free = False
        with pytest.raises(AdmissionRejected, match="about 0.6 s to admit"):
            await q.admit(room.attempt("d"), bool, 0.3)
        assert q.counters.rejected_expected_wait == 2

    asyncio.run(run())


def test_admission_wait_plays_the_queue_forward_over_the_running_requests_ends():
    def need(blocks, cheaper=None):  # blocks needed anywhere, or 1 on the worker holding its prefix
        return lambda w: 1 if w == cheaper else blocks

    # w1 frees 3 at 0.5 s: the first waiter (4) fits there (2 + 3); the newcomer (4) gets w0's 4 at 1 s
    ends = [(1.0, "w0", 4, 1), (0.5, "w1", 3, 1)]
    assert admission_wait(0.0, {"w0": 0, "w1": 2}, {"w0": 9, "w1": 9}, ends,
                          [(need(4), 1, 10.0), (need(4), 1, 10.0)]) == 1.0
    # the first waiter's own end (0.5 + 0.2) gives w1 back before w0 frees
    assert admission_wait(0.0, {"w0": 0, "w1": 2}, {"w0": 9, "w1": 9}, ends,
                          [(need(4), 1, 0.2), (need(4), 1, 10.0)]) == pytest.approx(0.7)
    # a waiter takes the worker where it needs fewest blocks; here w0, so the newcomer fits w1 at 0.5 s
    assert admission_wait(0.0, {"w0": 4, "w1": 2}, {"w0": 9, "w1": 9}, [(0.5, "w1", 3, 1), (0.1, "w0", 0, 0)],
                          [(need(5, cheaper="w0"), 1, 10.0), (need(5), 1, 10.0)]) == 0.5
    # no seat on w0: its blocks do not help; a worker the view dropped gives nothing back
    assert admission_wait(0.0, {"w0": 0}, {"w0": 0}, [(0.3, "w0", 8, 0), (0.1, "gone", 8, 1)],
                          [(need(4), 1, 1.0)]) is None
    assert admission_wait(2.0, {"w0": 0}, {"w0": 1}, [(2.0, "w0", 8, 1)], [(need(4), 1, 1.0)]) == 0.0
    assert admission_wait(0.0, {"w0": 0}, {"w0": 1}, [], [(need(4), 1, 1.0)]) is None


def test_admission_wait_tries_only_the_worker_that_got_room_back_and_still_agrees_with_trying_all():
    import heapq
    import random

    def every_worker_each_time(now, room, seats, ends, queue):  # the plain rule, for reference
        heap, room, seats, admitted = sorted(ends), dict(room), dict(seats), 0
        while heap:
            t, worker, blocks, seqs = heapq.heappop(heap)
            if worker not in room:
                continue
            room[worker] += blocks
            seats[worker] += seqs
            while admitted < len(queue):
                need_at, n, runs_s = queue[admitted]
                fits = [(need_at(w), -room[w], w) for w in room if seats[w] >= n and room[w] >= need_at(w)]
                if not fits:
                    break
                need, _, w = min(fits)
                room[w] -= need
                seats[w] -= n
                admitted += 1
                if admitted == len(queue):
                    return max(t - now, 0.0)
                heapq.heappush(heap, (t + runs_s, w, need, n))
        return None

    rng = random.Random(7)
    workers = [f"w{i}" for i in range(6)]
    answered = 0
    for _ in range(500):
        room = {w: rng.randint(-10, 4) for w in workers}
        seats = {w: rng.randint(0, 3) for w in workers}
        ends = [(round(rng.uniform(0, 5), 2), rng.choice(workers + ["gone"]), rng.randint(0, 8), rng.randint(0, 2))
                for _ in range(rng.randint(0, 12))]
        queue = []
        for _ in range(rng.randint(1, 5)):
            cheap = rng.choice(workers)
            full, n = rng.randint(1, 12), rng.randint(1, 2)
            queue.append(((lambda w, cheap=cheap, full=full: max(full - 6, 0) if w == cheap else full), n,
                          rng.uniform(0.1, 3)))
        got = admission_wait(0.0, room, seats, ends, queue)
        assert got == every_worker_each_time(0.0, room, seats, ends, queue)
        answered += got is not None
    assert 100 < answered < 500  # both outcomes were exercised


def kv_client(options: KVRoutingOptions, workers=("w0", "w1"), free=64):
    """A routing client over a mirror synced (at t=0) to workers each with ``free`` of 64 blocks free."""
    actor_core = GlobalScheduler()
    feed = ViewFeed("e1")
    for w in workers:
        b = KVEventBatch(w, 0, 0, False, num_free_blocks=free, num_total_blocks=64)
        actor_core.apply_batch(b, 0.0)
        feed.append(b)
    mirror = SchedulerMirror(weight=4.0)
    mirror.apply(feed.update_since(None, -1, actor_core), now=0.0)
    clock = [0.0]
    metrics = RouterMetrics(default_tags={"model_name": "tiny"})  # records only inside a Ray worker
    return KVRoutingClient(mirror, options, block_size=16, metrics=metrics, clock=lambda: clock[0]), clock


def test_routing_client_decides_locally_counts_and_refuses_past_the_wait():
    async def run():
        client, clock = kv_client(KVRoutingOptions(admission_queue_size=1, admission_max_wait_s=0.05), free=8)
        got = await client.route("r1", b"", 40, 24, 1)  # 4 blocks: w0 (tie broken by id)
        assert got.ranking == ["w0", "w1"] and got.reason == "load" and got.admitted
        got = await client.route("r2", b"", 40, 24, 1)  # w0 has 4 predicted: w1 is cheaper
        assert got.ranking == ["w1", "w0"]
        assert (await client.route("r3", b"", 40, 24, 1)).ranking == ["w0", "w1"]
        assert (await client.route("r4", b"", 40, 24, 1)).ranking == ["w1"]  # w0 has no room left: unranked
        # both workers' 8 free blocks are predicted away: r5 waits, then 429 (the clock moves on)

        async def later():
            await asyncio.sleep(0.01)
            clock[0] = 0.5
        mover = asyncio.create_task(later())
        with pytest.raises(OpenAIError) as info:
            await client.route("r5", b"", 40, 24, 1)
        await mover
        err = info.value
        assert (err.status_code, err.code, err.type, err.retry_after_s) == (429, "rate_limit_exceeded", "requests", 1)
        c = client.counters
        assert (dict(c.decisions), c.fallbacks, c.rejected) == ({"load": 4}, 0, 1)

    asyncio.run(run())


def test_a_stale_view_routes_by_this_ingresss_own_load_and_counts_fallbacks():
    async def run():
        client, clock = kv_client(KVRoutingOptions(admission_queue_size=4, max_staleness_s=1.0), free=64)
        clock[0] = 1.5  # no update for 1.5 s: the view is stale
        got = await client.route("r1", b"", 40, 24, 1)
        assert (got.ranking, got.reason, got.admitted) == (["w0", "w1"], "fallback_stale", True)
        got = await client.route("r2", b"", 40, 24, 1)  # w0 holds r1's 4 blocks (this ingress's count)
        assert got.ranking == ["w1", "w0"]
        client.finished("r1")
        assert (await client.route("r3", b"", 40, 24, 1)).ranking == ["w0", "w1"]
        assert (client.counters.fallbacks, dict(client.counters.decisions)) == (3, {})

    asyncio.run(run())


def test_route_by_inflight_ranks_by_held_blocks_and_admits_only_with_room():
    d = route_by_inflight({"a": 10, "b": 10, "c": 10}, {"a": 4, "b": 9}, need=3)
    assert (d.ranking, d.admitted, d.reason) == (["c", "a"], True, "fallback_stale")
    d = route_by_inflight({"a": 10, "b": 10}, {"a": 8, "b": 9}, need=3)
    assert (d.ranking, d.admitted) == (["a", "b"], False)


def test_a_view_with_no_worker_yet_routes_without_a_ranking_and_admission_off_forces_a_route():
    async def run():
        client, _ = kv_client(KVRoutingOptions(admission_queue_size=4), workers=())
        assert await client.route("r1", b"", 40, 24, 1) is None
        assert client.counters.fallbacks == 1
        client, _ = kv_client(KVRoutingOptions(admission_queue_size=0), free=2)  # room for nobody
        got = await client.route("r2", b"", 40, 24, 1)  # no admission control: routed anyway
        assert (got.ranking, got.admitted) == (["w0", "w1"], False)
        assert client.mirror.core.workers["w0"].predicted_blocks == 4  # forced: counted where it went

    asyncio.run(run())


def test_routing_client_refuses_on_arrival_a_request_its_running_requests_cannot_make_room_for_in_time():
    async def run():
        client, clock = kv_client(KVRoutingOptions(admission_queue_size=8, admission_max_wait_s=1.2), free=4)
        assert (await client.route("r1", b"", 40, 24, 1)).ranking == ["w0", "w1"]  # 4 blocks: w0 is full
        clock[0] = 0.2
        client.streamed("r1", 1)
        clock[0] = 0.5
        assert (await client.route("r2", b"", 40, 24, 1)).ranking == ["w1"]  # and now w1
        clock[0] = 0.66
        client.streamed("r1", 23)  # 23 tokens in 0.46 s after the first
        client.finished("r1", completed=True)
        assert (client.ttft_s, client.tpot_s) == (pytest.approx(0.2), pytest.approx(0.02))
        clock[0] = 0.7
        client.streamed("r2", 1)
        clock[0] = 0.8
        client.streamed("r2", 5)  # r2's own pace, 0.02 s a token: its 18 left end at 1.16 s
        # Nobody has room (the view still holds r1's and r2's predicted blocks). r3 gets w1 when
        # r2 ends, 0.36 s from now (0.56 s with a time to first token for the prefills r2 may
        # yet wait for; 1.12 s counted double while no waiter has checked an estimate), and
        # waits; r4 would wait for r3's end: 0.2 s to its first token and 23 more at 0.02 s,
        # 1.82 s, 1.02 s from now (1.22 s, 2.44 s), more than the 1.2 s it may wait
        r3 = asyncio.create_task(client.route("r3", b"", 40, 24, 1))
        await asyncio.wait_for(until(lambda: len(client.admission) == 1), 5)
        with pytest.raises(OpenAIError, match="about 2.4 s to admit") as info:
            await asyncio.wait_for(client.route("r4", b"", 40, 24, 1), 5)  # at once, not after waiting
        assert info.value.status_code == 429 and client.admission.counters.rejected_expected_wait == 1
        client.finished("r2")  # aborted: it says nothing about how long requests take
        assert (client.ttft_s, client.tpot_s) == (pytest.approx(0.2), pytest.approx(0.02))
        r3.cancel()
        with pytest.raises(asyncio.CancelledError):
            await r3

    asyncio.run(run())
