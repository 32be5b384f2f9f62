"""--scheduling-policy priority end to end, on a one-seat engine (max_num_seqs 1) of the tiny
checkpoint: a request of a lower priority value that arrives after a queue of others is served
before them. Through the real OpenAI app, the ingress's worker client and a worker replica (Serve's
handle stood in for by direct calls), and at the engine's own queue."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pagefleet.router.ingress import HandleWorkerClient, load_model_info
from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.service import OpenAIService
from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams
from pagefleet.worker.replica.deployment import WorkerReplica

from channel_fakes import ReplicaHandle

LONG = 1000  # the first request's tokens: it runs while the others queue behind it
SHORT = 8


@pytest.fixture(scope="module")
def args(tiny_checkpoint):
    return EngineArgs(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu", max_model_len=2048,
                      max_num_seqs=1, kv_cache_bytes=16 << 20, scheduling_policy="priority")


@pytest.fixture(scope="module")
def engine(args):
    eng = AsyncLLMEngine(args)
    yield eng
    eng.shutdown()


async def _until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.002)


def test_through_the_app_a_better_priority_takes_the_replicas_next_seat(args, engine):
    """The replica holds 2 x max_num_seqs requests in its engine (one running, one waiting); the
    rest wait for a seat, by priority. ``high`` arrives last with priority -1 and is served before
    ``low3`` and ``low4``, which waited longer."""
    tokenizer, info = load_model_info(args)
    assert info.limits.scheduling_policy == "priority"

    async def run() -> tuple[list[str], dict[str, dict]]:
        replica = WorkerReplica(args, engine_factory=lambda _: engine)
        client = HandleWorkerClient(ReplicaHandle(replica))
        app = build_openai_app(OpenAIService(tokenizer=tokenizer, info=info, client=client))
        order: list[str] = []
        bodies: dict[str, dict] = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            async def send(name: str, max_tokens: int, priority: int, chat: bool = False) -> None:
                body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "priority": priority}
                if chat:
                    r = await http.post("/v1/chat/completions",
                                        json={**body, "messages": [{"role": "user", "content": name}]})
                else:
                    r = await http.post("/v1/completions", json={**body, "prompt": f"request {name}"})
                assert r.status_code == 200, r.text
                order.append(name)
                bodies[name] = r.json()

            tasks = [asyncio.ensure_future(send("low1", LONG, 5))]
            await _until(lambda: engine.stats().num_running == 1)
            tasks.append(asyncio.ensure_future(send("low2", SHORT, 5)))
            await _until(lambda: replica.seats.taken == 2)
            tasks += [asyncio.ensure_future(send("low3", SHORT, 5)), asyncio.ensure_future(send("low4", SHORT, 5))]
            await _until(lambda: len(replica.seats.waiters) == 2)
            tasks.append(asyncio.ensure_future(send("high", SHORT, -1, chat=True)))
            await _until(lambda: len(replica.seats.waiters) == 3)
            assert order == []  # low1 still runs: everything else queued behind it
            await asyncio.gather(*tasks)
        replica._channel_server.close()
        return order, bodies

    order, bodies = asyncio.run(run())
    # low2 was in the engine's queue when high took low1's seat; which of the two the engine
    # admits next depends on whether high reaches it first (both orders serve high before low3).
    assert order[0] == "low1" and sorted(order[1:3]) == ["high", "low2"] and order[3:] == ["low3", "low4"]
    assert {name: b["usage"]["completion_tokens"] for name, b in bodies.items()} == {
        "low1": LONG, "low2": SHORT, "low3": SHORT, "low4": SHORT, "high": SHORT}


def test_the_engine_admits_a_late_better_priority_before_the_waiting_queue(engine):
    """All five requests in the engine: low1 runs, low2..low4 wait, then high (priority -1)
    arrives and is admitted next, before the three that waited longer."""
    ids = engine.tokenizer.encode("priority test")

    async def run() -> list[str]:
        order: list[str] = []

        async def send(name: str, max_tokens: int, priority: int) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            async for delta in engine.generate(name, ids, params, priority=priority):
                if delta.finished:
                    order.append(name)

        tasks = [asyncio.ensure_future(send("low1", LONG, 0))]
        await _until(lambda: engine.stats().num_running == 1)
        tasks += [asyncio.ensure_future(send(f"low{i}", SHORT, 0)) for i in (2, 3, 4)]
        await _until(lambda: engine.stats().num_waiting == 3)
        tasks.append(asyncio.ensure_future(send("high", SHORT, -1)))
        await _until(lambda: engine.stats().num_waiting == 4)
        assert order == []
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == ["low1", "high", "low2", "low3", "low4"]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_preemptions == 0
