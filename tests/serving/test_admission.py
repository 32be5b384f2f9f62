"""Admission control and the ingress's kv routing client (deciding with its copy of the view),
without Ray: exact orders and counts."""

from __future__ import annotations

import asyncio
import math

import pytest

from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.kv_mirror import SchedulerMirror
from pagefleet.router.global_scheduler.view_feed import ViewFeed
from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.openai.errors import OpenAIError
from pagefleet.router.routing.admission import WAITED_OUT, AdmissionQueue, AdmissionRejected, _Waiter
from pagefleet.router.routing.kv_routing import (
    VIEW_LAG_S,
    KVRoutingClient,
    KVRoutingOptions,
    request_blocks,
    route_by_inflight,
)
from pagefleet.router.routing.room_forecast import Need
from pagefleet.worker.core.kv_events import KVEventBatch, Release, pack_releases


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


def test_a_better_priority_waits_ahead_of_worse_ones_but_behind_the_head():
    async def run():
        q, room = AdmissionQueue(max_size=5, max_wait_s=5.0, retry_s=0.001), Room()
        order: list[str] = []

        async def client(name: str, priority: int) -> None:
            await q.admit(room.attempt(name), bool, priority=priority)
            order.append(name)

        tasks = []
        for name, priority in (("a", 5), ("b", 5), ("c", 0), ("d", 5), ("e", -1)):
            tasks.append(asyncio.create_task(client(name, priority)))
            while len(q) < len(tasks):
                await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        assert set(room.asked) == {"a"}  # the head alone asks, whatever arrives behind it
        room.free = True
        await asyncio.gather(*tasks)
        assert order == ["a", "e", "c", "b", "d"]

    asyncio.run(run())


def test_a_newcomers_forecast_wait_is_read_at_its_place_by_priority():
    """Two waiters ahead with the forecast saying 1 s, 3 s and 5 s for the first three places
    (max_wait 4 s): a newcomer of priority 0 behind two of priority 5 would be third (5 s:
    refused); of priority -1 it is second, behind the head (3 s: it waits)."""
    forecast = lambda needs: [1.0 + 2.0 * i for i in range(len(needs))]  # noqa: E731
    q = AdmissionQueue(max_size=8, max_wait_s=4.0, retry_s=0.01, forecast=forecast, review_s=0.1)
    q._waiting.extend([_Waiter("h", 10.0, 5), _Waiter("w", 10.0, 5)])
    with pytest.raises(AdmissionRejected) as refused:
        q.check_room("new", priority=5)
    assert refused.value.reason == "expected_wait" and "about 5.0 s" in str(refused.value)
    q.check_room("new", priority=-1)
    assert q._place(-1) == 1 and q._place(5) == 2

def test_a_full_queue_refuses_at_once():
    async def run():
        q, room = AdmissionQueue(max_size=1, max_wait_s=5.0, retry_s=0.001), Room()
        waiting = asyncio.create_task(q.admit(room.attempt("a"), bool))
        while len(q) < 1:
            await asyncio.sleep(0.001)
        with pytest.raises(AdmissionRejected, match="1 requests are already waiting") as info:
            await q.admit(room.attempt("b"), bool)
        assert info.value.retry_after_s == 5 and WAITED_OUT not in str(info.value)  # refused on arrival
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
        with pytest.raises(AdmissionRejected, match="within 0.3 s") as info:
            await first
        # What benchmarks/routing.py tells a refusal after waiting by.
        assert info.value.reason == "waited_too_long" and str(info.value).startswith(WAITED_OUT)
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


def test_request_blocks_of_a_windowed_model_stop_at_what_a_sequence_holds():
    # Every layer sliding, a sequence holds at most 5 blocks: a 40 + 300-token request needs 5, not
    # 22; three samples 15 (their prompt blocks leave the window, so none is counted as shared).
    assert request_blocks(40, 300, 1, 16, max_blocks_per_seq=5) == 5
    assert request_blocks(40, 300, 3, 16, max_blocks_per_seq=5) == 15
    assert request_blocks(40, 300, 1, 16) == 22
    assert request_blocks(20, 10, 1, 16, max_blocks_per_seq=5) == 2  # shorter than the cap


def test_ingress_model_info_caps_a_windowed_sequence(tiny_checkpoint):
    from pagefleet.router.ingress import load_model_info
    from pagefleet.worker.engine_args import EngineArgs

    # A 24-token window, 32-token steps, blocks of 16: 23 + 32 + 16 tokens = 5 blocks.
    _, info = load_model_info(EngineArgs(model=str(tiny_checkpoint("mistral", sliding_window=24)),
                                         max_num_batched_tokens=32))
    assert info.max_blocks_per_seq == 5 and info.limits.max_model_len == 2048
    _, info = load_model_info(EngineArgs(model=str(tiny_checkpoint("qwen2", sliding_window=20, max_window_layers=1))))
    assert info.max_blocks_per_seq is None  # its full-attention layer keeps every block


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
        assert q.expected_wait_s() is None  # nothing has left the queue yet: no rate to go by
        for t, name in ((0.4, "a"), (0.8, "b")):  # a, then b, leave 0.4 s apart
            now[0] = t
            allowed.add(name)
            await tasks[name]
        # c and d wait; one interval seen (0.4 s): a newcomer would be third, 1.2 s > 1.0 s
        assert (len(q), q.departure_interval_s) == (2, pytest.approx(0.4))
        with pytest.raises(AdmissionRejected, match="about 1.2 s to admit") as info:
            q.check_room()
        assert info.value.reason == "expected_wait" and q.counters.rejected_expected_wait == 1
        assert WAITED_OUT not in str(info.value)
        with pytest.raises(AdmissionRejected):
            await q.admit(attempt("e"), bool)
        assert "e" not in asked and q.counters.rejected_expected_wait == 2
        allowed.update("cd")
        await asyncio.gather(*tasks.values())
        assert q.expected_wait_s() is None  # an empty queue has no wait

    asyncio.run(run())


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


def test_the_routing_client_admits_waiters_by_priority_as_room_frees():
    async def run():
        client, _ = kv_client(KVRoutingOptions(admission_queue_size=8, admission_max_wait_s=30.0), free=8)
        for rid in ("r1", "r2", "r3", "r4"):  # 4 blocks each: both workers' room predicted away
            assert (await client.route(rid, b"", 40, 24, 1)).admitted
        order: list[str] = []

        async def waiter(rid: str, priority: int) -> None:
            await client.route(rid, b"", 40, 24, 1, priority)
            order.append(rid)

        tasks = []
        for rid, priority in (("low1", 5), ("low2", 5), ("high", -1)):
            tasks.append(asyncio.create_task(waiter(rid, priority)))
            while len(client.admission) < len(tasks):
                await asyncio.sleep(0.001)
        for done, ended in enumerate(("r1", "r2", "r3"), start=1):
            client.finished(ended)  # 4 blocks back: room for the next waiter
            while len(order) < done:
                await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        assert order == ["low1", "high", "low2"]

    asyncio.run(run())

def test_a_request_that_ends_before_its_worker_reports_it_frees_its_room_for_the_next():
    """A stream its client closed before the worker took the request in: without the withdrawal
    its predicted blocks and seat would stay taken until the prediction's time ran out."""
    async def run():
        client, _ = kv_client(KVRoutingOptions(admission_queue_size=1, admission_max_wait_s=0.05), free=8)
        for rid in ("r1", "r2", "r3", "r4"):  # 4 blocks each: both workers' 8 free blocks predicted away
            await client.route(rid, b"", 40, 24, 1)
        views = client.mirror.core.workers
        assert (views["w0"].room_blocks, views["w1"].room_blocks) == (0, 0)
        client.finished("r3")  # routed to w0, never reported there
        got = await asyncio.wait_for(client.route("r6", b"", 40, 24, 1), 5.0)  # (this clock stands still)
        assert (got.ranking, got.admitted) == (["w0"], True)
        assert client.mirror.core.counters.predictions_withdrawn == 1

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


class Forecast:
    """A forecast of each waiter's wait, by its name (the ``need`` it was admitted with)."""

    def __init__(self, **waits: float) -> None:
        self.waits = waits
        self.asked: list[list[str]] = []

    def __call__(self, needs):
        self.asked.append(list(needs))
        return [self.waits[n] for n in needs]


def test_a_forecast_past_the_limit_refuses_a_newcomer_at_once_with_its_wait():
    async def run():
        forecast = Forecast(a=1.5, b=math.inf)
        q, room = AdmissionQueue(max_size=10, max_wait_s=1.0, clock=lambda: 0.0, forecast=forecast), Room()
        with pytest.raises(AdmissionRejected, match="expected in about 1.5 s") as info:
            await q.admit(room.attempt("a"), bool, need="a")
        assert (info.value.reason, info.value.retry_after_s) == ("expected_wait", 2)  # its wait, rounded up
        with pytest.raises(AdmissionRejected, match="not enough for this request and those ahead of it") as info:
            await q.admit(room.attempt("b"), bool, need="b")
        assert (info.value.reason, info.value.retry_after_s) == ("expected_wait", 1)  # the maximum wait
        # a forecast must leave one review and one retry (70 ms) of the wait: 0.96 s of 1 s does not
        forecast.waits["c"] = 0.96
        with pytest.raises(AdmissionRejected):
            await q.admit(room.attempt("c"), bool, need="c")
        # each asked once on arrival and never queued; the forecast saw each alone
        assert (room.asked, forecast.asked, len(q)) == (["a", "b", "c"], [["a"], ["b"], ["c"]], 0)
        c = q.counters
        assert (c.rejected_expected_wait, c.refused_while_waiting, c.rejected_waited_too_long) == (3, 0, 0)

    asyncio.run(run())


def test_a_waiting_request_is_refused_as_soon_as_its_forecast_passes_its_time_left():
    async def run():
        now = [0.0]  # still: nobody's wait runs out
        forecast = Forecast(a=0.5, b=0.8)
        q = AdmissionQueue(max_size=10, max_wait_s=1.0, retry_s=0.001, review_s=0.0, clock=lambda: now[0],
                           forecast=forecast)
        room = Room()
        a = asyncio.create_task(q.admit(room.attempt("a"), bool, need="a"))
        b = asyncio.create_task(q.admit(room.attempt("b"), bool, need="b"))
        while len(q) < 2:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        assert forecast.asked[-1] == ["a", "b"] and not b.done()  # the head's reviews forecast both, in order
        forecast.waits["b"] = 1.2  # the workers now say b's room comes after its 1 s is up
        with pytest.raises(AdmissionRejected, match=r"about 1.2 s .*, more than the 1.0 s it may wait") as info:
            await b
        assert info.value.reason == "expected_wait" and not a.done()
        room.free = True
        assert await a is True
        c = q.counters
        assert (c.admitted_after_waiting, c.rejected_expected_wait, c.refused_while_waiting,
                c.rejected_waited_too_long) == (1, 1, 1, 0)
        assert set(room.asked) == {"a"}  # b never reached the head

    asyncio.run(run())


def test_without_a_forecast_to_go_by_a_newcomer_waits_as_before():
    async def run():
        q, room = AdmissionQueue(max_size=10, max_wait_s=1.0, retry_s=0.001, forecast=lambda needs: None), Room()
        a = asyncio.create_task(q.admit(room.attempt("a"), bool, need="a"))
        while len(q) < 1:
            await asyncio.sleep(0.001)
        room.free = True
        assert await a is True and q.counters.admitted_after_waiting == 1

    asyncio.run(run())


def _client_over_copy(steps_left: dict[str, int], free_blocks: int):
    """A routing client over an ingress's copy of the view of workers of 64 blocks, each with
    ``free_blocks`` free and one running sequence that ends within its steps of 50 ms, freeing 8
    blocks: (the client, its clock, ``follow(now)``: the copy takes the feed's news, returned)."""
    actor_core, feed = GlobalScheduler(), ViewFeed("e1")
    for w, steps in steps_left.items():
        b = KVEventBatch(w, 0, 0, False, num_free_blocks=free_blocks, num_total_blocks=64, num_running=1,
                         releases=pack_releases([Release(steps, 1, 8)]), step_time_s=0.05)
        actor_core.apply_batch(b, 0.0)
        feed.append(b)
    mirror = SchedulerMirror(weight=4.0)
    mirror.apply(feed.update_since(None, -1, actor_core), now=0.0)
    clock = [0.0]
    client = KVRoutingClient(mirror, KVRoutingOptions(admission_max_wait_s=0.5), block_size=16,
                             clock=lambda: clock[0])
    cursor = [len(steps_left) - 1]

    def follow(now: float, *batches: KVEventBatch) -> SchedulerMirror:
        """The workers' ``batches`` reach the actor's view, and the copy takes the feed's news."""
        for b in batches:
            actor_core.apply_batch(b, now)
            feed.append(b)
        update = feed.update_since("e1", cursor[0], actor_core)
        mirror.apply(update, now=now)
        cursor[0] = update.cursor
        return mirror

    return client, clock, follow


def test_the_routing_clients_forecast_reads_the_workers_releases_in_its_copy_of_the_view():
    async def run():
        # both full (no block free); w0's running sequences end within 10 steps of 50 ms and free 8
        # blocks, w1's within 30 steps
        client, clock, _ = _client_over_copy({"w0": 10, "w1": 30}, free_blocks=0)
        # room shows 0.5 s (w0) and 1.5 s (w1) from now, plus the view's lag: two 4-block requests
        # fit w0's 8 blocks, the third waits for w1
        assert client.forecast_waits([Need(4)] * 3) == pytest.approx([0.5 + VIEW_LAG_S] * 2 + [1.5 + VIEW_LAG_S])
        with pytest.raises(OpenAIError, match=f"expected in about {0.5 + VIEW_LAG_S:.1f} s") as info:
            await client.route("r1", b"", 40, 24, 1)  # 4 blocks; the wait passes 0.5 s: refused at once
        assert (info.value.status_code, info.value.retry_after_s) == (429, 1)
        assert client.admission.counters.rejected_expected_wait == 1 and len(client.admission) == 0
        clock[0] = 1.5  # no update for 1.5 s: a stale copy forecasts nothing
        assert client.forecast_waits([Need(4)]) is None

    asyncio.run(run())


def test_a_request_of_its_own_unreported_past_the_staleness_limit_turns_the_forecast_off():
    """The copy is behind the workers (the actor restarting): its room for that request would be
    counted twice, so the queue goes by the departure rate instead of refusing on it."""

    async def run():
        client, clock, follow = _client_over_copy({"w0": 10}, free_blocks=64)
        await client.route("r1", b"", 40, 24, 1)  # room now: routed, not yet reported by w0
        assert client.forecast_waits([Need(4)]) == [0.0]
        clock[0] = 1.2
        mirror = follow(1.2)  # the copy is fresh, r1 still unreported
        assert mirror.age(1.2) <= 1.0
        assert client.forecast_waits([Need(4)]) is None

    asyncio.run(run())


@pytest.mark.parametrize("cut_short", [True, False])
def test_a_request_cut_short_here_gives_its_room_back_in_the_forecast_a_step_after_it_ended(cut_short):
    """Its worker took it in, so its room is in the worker's own numbers, due back when the
    worker's last batch said (all its steps from now); a client that went away ends it sooner, and
    until the worker's next batch shows that, the forecast counts the room back a step after the
    end (plus the view's lag). A request that ran to its end is in the worker's releases already."""
    async def run():
        client, clock, follow = _client_over_copy({"w0": 100}, free_blocks=4)  # its sequence ends in 5 s
        await client.route("r1", b"", 40, 24, 1)  # 4 blocks: w0's last 4
        clock[0] = 0.05
        follow(0.05, KVEventBatch("w0", 1, 1, False, num_free_blocks=0, num_total_blocks=64, num_running=2,
                                  added=["r1"], step_time_s=0.05,
                                  releases=pack_releases([Release(24, 1, 4), Release(99, 1, 8)])))
        # the worker's word: r1's 4 blocks back after its 24 steps
        assert client.forecast_waits([Need(4)]) == pytest.approx([24 * 0.05 + VIEW_LAG_S])
        clock[0] = 0.1
        client.finished("r1", cut_short=cut_short)
        if not cut_short:
            assert client.forecast_waits([Need(4)]) == pytest.approx([1.15 + VIEW_LAG_S])
            with pytest.raises(OpenAIError, match="expected in about"):
                await client.route("r2", b"", 40, 24, 1)  # past the 0.5 s it may wait
            return
        # ended at 0.1: back one 50 ms step later, plus the lag (0.35 s from now)
        assert client.forecast_waits([Need(4)]) == pytest.approx([0.05 + VIEW_LAG_S])
        r2 = asyncio.create_task(client.route("r2", b"", 40, 24, 1))  # waits instead of a 429
        while not len(client.admission):
            await asyncio.sleep(0.001)
        # the worker's batch after the abort: r1's blocks are free; counted once, not twice
        clock[0] = 0.5
        follow(0.5, KVEventBatch("w0", 2, 2, False, num_free_blocks=4, num_total_blocks=64, num_running=1,
                                 step_time_s=0.05, releases=pack_releases([Release(91, 1, 8)])))
        assert client.forecast_waits([Need(8)]) == pytest.approx([91 * 0.05 + VIEW_LAG_S])
        got = await asyncio.wait_for(r2, 5.0)
        assert (got.ranking, got.admitted) == (["w0"], True)
        assert client.admission.counters.rejected_expected_wait == 0

    asyncio.run(run())
