"""Admission control and the ingress's kv routing client, without Ray: exact orders and counts."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.router.admission import AdmissionQueue, AdmissionRejected
from pagefleet.router.errors import OpenAIError
from pagefleet.router.global_scheduler import RouteDecision
from pagefleet.router.kv_routing import KVRoutingClient, KVRoutingOptions, request_blocks


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


class FakeScheduler:
    """The actor's ``route`` as an awaitable, answering what the test says (or hanging, or dying)."""

    def __init__(self) -> None:
        self.answers: list = []
        self.calls: list[tuple[str, bool]] = []
        self.route = self

    def remote(self, req, force):
        self.calls.append((req.request_id, force))
        answer = self.answers.pop(0)

        async def reply():
            if answer == "hang":
                await asyncio.sleep(10)
            if isinstance(answer, Exception):
                raise answer
            return answer
        return reply()


def decision(admitted=True, reason="prefix", hit=3):
    return RouteDecision(["w1", "w0"], admitted, reason if admitted else "no_room", hit)


def test_routing_client_counts_decisions_fallbacks_and_refusals():
    async def run():
        sched = FakeScheduler()
        # a timeout long enough that only the "hang" answer misses it, however busy the machine
        client = KVRoutingClient(sched, KVRoutingOptions(admission_queue_size=1, admission_max_wait_s=0.05,
                                                         timeout_s=0.5), block_size=16)
        sched.answers = [decision()]
        got = await client.route("r1", b"", 40, 24, 1)
        assert got.ranking == ["w1", "w0"] and sched.calls == [("r1", False)]
        sched.answers = ["hang"]  # too slow: routed without it
        assert await client.route("r2", b"", 40, 24, 1) is None
        sched.answers = [decision(admitted=False)] * 20  # no room, ever: waits, then 429
        with pytest.raises(OpenAIError) as info:
            await client.route("r3", b"", 40, 24, 1)
        err = info.value
        assert (err.status_code, err.code, err.type, err.retry_after_s) == (429, "rate_limit_exceeded", "requests", 1)
        c = client.counters
        assert (dict(c.decisions), c.fallbacks, c.rejected, c.predicted_hit_blocks) == ({"prefix": 1}, 1, 1, 3)

    asyncio.run(run())


def test_a_failed_scheduler_is_skipped_for_a_while_and_admission_off_forces_a_route():
    async def run():
        sched = FakeScheduler()
        client = KVRoutingClient(sched, KVRoutingOptions(admission_queue_size=0), block_size=16)
        sched.answers = [ConnectionError("actor died")]
        assert await client.route("r1", b"", 40, 24, 1) is None
        assert await client.route("r2", b"", 40, 24, 1) is None  # not even asked: skipped
        assert [c[0] for c in sched.calls] == ["r1"] and client.counters.fallbacks == 2
        client._skip_until = 0.0
        sched.answers = [decision(admitted=False)]
        got = await client.route("r3", b"", 40, 24, 1)  # no admission control: routed anyway
        assert got.ranking == ["w1", "w0"] and sched.calls[-1] == ("r3", True)

    asyncio.run(run())
