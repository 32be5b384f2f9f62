"""Requests sent on a replica's channel connection instead of through Serve: a real worker
replica (its engine scripted) and a real ingress mux over loopback TCP."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.router.ingress import HandleWorkerClient
from pagefleet.router.openai.service import Job
from pagefleet.router.routing import request_router
from pagefleet.router.worker_client.delta_mux import ChannelLost, ChannelMux, ReplicaBusy, read_deltas
from pagefleet.router.worker_client.worker_errors import worker_failure
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.replica import delta_channel
from pagefleet.worker.replica.deployment import WorkerReplica
from pagefleet.worker.replica.wire import ChannelOpen, Ended, Placed, WorkerRequest, encode_batch
from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import SamplingParams

from channel_fakes import Call, ReasonMetrics, ReplicaHandle, SteppedEngine, delta, settle, until


class RefusingEngine(SteppedEngine):
    """Refuses every request the way the engine refuses a bad one: when its stream is first read."""

    async def generate(self, request_id, prompt_token_ids, params, extra_keys=(), block_hashes=None, span=None,
                       resume=None, forward=None, client="", priority=0, lora_name=None, lora_path=None):
        self.started.append(request_id)
        raise InvalidRequest("stop has 40 strings", "stop")
        yield  # an async generator, like the engine's


def _request(request_id: str, max_tokens: int) -> WorkerRequest:
    return WorkerRequest(request_id, [1, 2], SamplingParams(max_tokens=max_tokens), ranking=["local"],
                         channel="c1")


def _mux(replica: WorkerReplica, opened: list[ChannelOpen] | None = None) -> ChannelMux:
    def open_channel(request: ChannelOpen) -> Call:
        if opened is not None:
            opened.append(request)
        return Call(replica.channel(request))

    return ChannelMux(open_channel, channel_id="c1")


async def _connected(replica: WorkerReplica) -> ChannelMux:
    """A mux whose channel to the replica is an open connection (opened for an earlier request)."""
    mux = _mux(replica)
    mux.register("earlier")
    mux.placed("earlier", "local")
    await until(lambda: "local" in mux._connections and mux._connections["local"].open)
    mux.release("earlier")
    return mux


async def _sent(max_tokens: int, engine_factory=SteppedEngine, max_ongoing: int | None = None):
    """A replica, a mux connected to it, and request "a" sent on that connection: (replica, mux, a's queue)."""
    replica = WorkerReplica(EngineArgs(), engine_factory=engine_factory, channel_host="127.0.0.1")
    mux = await _connected(replica)
    if max_ongoing is not None:
        replica.seats.limit = max_ongoing
    q = mux.register("a")
    assert mux.send(_request("a", max_tokens), "local")
    return replica, mux, q


async def _close(replica: WorkerReplica, mux: ChannelMux) -> None:
    replica._channel_server.close()
    for connection in list(mux._connections.values()):
        connection._transport.close()
    for task in list(mux._readers.values()):
        task.cancel()
    await settle()


def test_a_request_sent_on_the_connection_streams_its_deltas_and_leaves_nothing_behind():
    async def run():
        replica, mux, q = await _sent(2)
        await until(lambda: replica.engine.started == ["a"])
        assert replica.seats.taken == 1 and replica._channels["c1"].requests == 1
        tokens = []
        for step in range(2):
            replica.engine.steps[step].set()
        async for d in read_deltas(q):
            tokens += d.sequences[0].token_ids
        await until(lambda: replica.seats.taken == 0)
        assert tokens == [0, 1] and replica.engine.closed == ["a"]
        assert replica._channels["c1"].requests == 0 and mux._sent == set()
        assert (mux.counters.sent, mux.counters.refused, mux.counters.unclaimed) == (1, 0, 0)
        await _close(replica, mux)

    asyncio.run(run())


def test_a_full_replica_refuses_a_request_on_the_connection_and_runs_nothing_of_it():
    async def run():
        replica, mux, q = await _sent(2, max_ongoing=0)
        with pytest.raises(ReplicaBusy):
            await asyncio.wait_for(read_deltas(q).__anext__(), 2.0)
        assert replica.engine.started == [] and replica.seats.taken == 0 and mux.counters.refused == 1
        assert mux._sent == set()
        # it goes through Serve, maybe to another replica, whose deltas can come before its Placed
        mux._dispatch("elsewhere", encode_batch([delta("a", 0)]))
        assert q.get_nowait() == delta("a", 0) and mux.counters.unclaimed == 0
        await _close(replica, mux)

    asyncio.run(run())


def test_a_request_the_engine_refuses_fails_with_the_engines_error_and_words():
    async def run():
        replica, mux, q = await _sent(2, engine_factory=RefusingEngine)
        with pytest.raises(InvalidRequest) as refused:
            await asyncio.wait_for(read_deltas(q).__anext__(), 2.0)
        await until(lambda: replica.seats.taken == 0)
        assert replica._channels["c1"].requests == 0
        await _close(replica, mux)
        return refused.value

    refused = asyncio.run(run())
    error, retry = worker_failure(refused)
    assert (error.status_code, error.param, error.message, retry) == (400, "stop", "stop has 40 strings", False)


def test_an_abort_on_the_connection_stops_the_request_in_the_engine():
    async def run():
        replica, mux, _ = await _sent(3)
        await until(lambda: replica.engine.started == ["a"])
        mux.abort("a")  # the client went away
        await until(lambda: replica.engine.closed == ["a"])
        await until(lambda: replica.seats.taken == 0)
        assert replica._channels["c1"].requests == 0 and mux._sent == set()
        await _close(replica, mux)

    asyncio.run(run())


def test_a_lost_connection_fails_its_running_requests_on_both_sides():
    async def run():
        replica, mux, q = await _sent(3)
        await until(lambda: replica.engine.started == ["a"])
        mux._connections["local"]._transport.close()
        with pytest.raises(ChannelLost):
            await asyncio.wait_for(read_deltas(q).__anext__(), 2.0)
        await until(lambda: replica.engine.closed == ["a"])  # the replica aborted it
        await until(lambda: replica.seats.taken == 0)
        assert mux._sent == set() and replica._channels["c1"].requests == 0
        mux.release("a")
        await _close(replica, mux)

    asyncio.run(run())
    error, retry = worker_failure(ChannelLost("gone"))
    assert (error.status_code, error.code, retry) == (503, "worker_failed", True)


def test_an_offer_nobody_claims_ends_its_channel_call(monkeypatch):
    monkeypatch.setattr(delta_channel, "OFFER_TTL_S", 0.05)

    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        call = replica.channel(ChannelOpen("c1", "local", socket=True))
        await call.__anext__()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(call.__anext__(), 2.0)
        replica._channel_server.close()

    asyncio.run(run())


class _Router:
    """What ``routable`` reads of a request router: the replicas it routes to."""

    def __init__(self, *replica_ids: str) -> None:
        self.curr_replicas = {_ReplicaID(r): None for r in replica_ids}


class _ReplicaID:
    def __init__(self, unique_id: str) -> None:
        self.unique_id = unique_id


async def _ingress_connected(replica: WorkerReplica):
    """The ingress's worker client over ``replica`` once its channel connection is open (request
    "first" went through Serve, which opened it, and finished): (handle, client, tokens), where
    ``tokens(request_id)`` is the output of one request ranked for the replica."""
    handle = ReplicaHandle(replica)
    client = HandleWorkerClient(handle)

    async def tokens(request_id: str) -> list[int]:
        job = Job(request_id, [1, 2], SamplingParams(max_tokens=2), ranking=["local"])
        return [t async for d in client.generate(job) for t in d.sequences[0].token_ids]

    first = asyncio.ensure_future(tokens("first"))  # no connection yet: through Serve, which opens the channel
    await until(lambda: "local" in client.mux._connections and client.mux._connections["local"].open)
    for step in replica.engine.steps:
        step.set()
    assert await first == [0, 1]
    return handle, client, tokens


def test_the_ingress_sends_on_the_connection_and_through_serve_when_it_must(monkeypatch):
    router = _Router("local")
    monkeypatch.setitem(request_router._ROUTERS, ("app", "PagefleetWorker"), lambda: router)

    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        handle, client, tokens = await _ingress_connected(replica)
        assert await tokens("on-connection") == [0, 1]
        replica.engine.steps = [asyncio.Event() for _ in range(8)]  # requests wait for their steps again
        replica.seats.limit = 1
        holder = asyncio.ensure_future(tokens("holder"))
        await until(lambda: replica.engine.started[-1:] == ["holder"])
        refused = asyncio.ensure_future(tokens("refused"))  # the replica is full: through Serve
        await until(lambda: len(replica.seats.waiters) == 1)  # whose call waits there for a seat
        assert replica.engine.started[-1] == "holder" and replica.seats.taken == 1
        for step in replica.engine.steps:
            step.set()
        assert (await holder, await refused) == ([0, 1], [0, 1])
        replica.seats.limit = 8
        router.curr_replicas = {}  # Serve is stopping the replica: no more requests on its connection
        assert await tokens("stopping") == [0, 1]
        assert [call for call, _ in handle.generate_calls] == ["first", "refused", "stopping"]
        assert (client.mux.counters.sent, client.mux.counters.refused) == (3, 1)
        assert replica.seats.taken == 0 and replica._channels[client.mux.channel_id].requests == 0
        await _close(replica, client.mux)

    asyncio.run(run())


def test_a_request_whose_connection_ends_before_its_first_output_goes_through_serve_as_ranked(monkeypatch):
    # The replica closes a channel idle for a few seconds, and a request sent on the connection just
    # then is lost with it (here: it started on the replica, then its connection ended). Nothing of
    # it reached the client: it goes through Serve, still ranked for the replica it was sent to,
    # spending no attempt (with one allowed it used to fail with a 503), and under an id of its own:
    # that replica still holds the first send until it notices the connection is gone, and an
    # engine refuses an id it is running (the same id failed here with a 500).
    from pagefleet.router import ingress

    router = _Router("local")
    monkeypatch.setitem(request_router._ROUTERS, ("app", "PagefleetWorker"), lambda: router)
    monkeypatch.setattr(ingress, "MAX_ATTEMPTS", 1)

    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        handle, client, tokens = await _ingress_connected(replica)
        client.metrics = ReasonMetrics()
        replica.engine.steps = [asyncio.Event() for _ in range(8)]
        lost = asyncio.ensure_future(tokens("lost"))
        await until(lambda: replica.engine.started[-1:] == ["lost"])  # running there, on the connection
        client.mux._connections["local"]._transport.abort()  # which then ends
        await until(lambda: handle.generate_calls[-1:] == [("lost#2", ["local"])])
        for step in replica.engine.steps:
            step.set()
        assert await lost == [0, 1]
        assert handle.generate_calls == [("first", ["local"]), ("lost#2", ["local"])]
        assert client.mux.counters.sent == 1
        assert client.metrics.resends == ["connection_lost"]
        await until(lambda: replica.seats.taken == 0)
        assert replica.engine.started == ["first", "lost", "lost#2"]
        assert sorted(replica.engine.closed) == ["first", "lost", "lost#2"]  # the first send aborted there
        await _close(replica, client.mux)

    asyncio.run(run())


def test_a_serve_call_past_the_limit_waits_for_a_seat_and_one_that_leaves_gives_it_up():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        replica.seats.limit = 1
        mux = await _connected(replica)
        mux.register("a")
        assert mux.send(_request("a", 1), "local")  # holds the one seat
        await until(lambda: replica.engine.started == ["a"])
        leaving = asyncio.ensure_future(replica.generate(_request("b", 1)).__anext__())
        waiting_call = replica.generate(_request("c", 1))
        waiting = asyncio.ensure_future(waiting_call.__anext__())
        await until(lambda: len(replica.seats.waiters) == 2)
        leaving.cancel()  # its client went away while it waited
        await settle()
        assert len(replica.seats.waiters) == 1 and replica.engine.started == ["a"]
        replica.engine.steps[0].set()  # a finishes: its seat goes to c, the next in line
        assert await asyncio.wait_for(waiting, 2.0) == Placed("local")
        assert replica.engine.started == ["a", "c"] and replica.seats.taken == 1
        assert await waiting_call.__anext__() == Ended(1)
        await waiting_call.aclose()
        assert replica.seats.taken == 0 and not replica.seats.waiters
        await _close(replica, mux)

    asyncio.run(run())


def test_a_serve_call_the_engine_refuses_gives_its_seat_back():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=RefusingEngine, channel_host="127.0.0.1")
        with pytest.raises(InvalidRequest, match="stop has 40 strings"):
            await replica.generate(WorkerRequest("a", [1, 2], SamplingParams(max_tokens=1))).__anext__()
        assert replica.seats.taken == 0 and replica.engine.started == ["a"]

    asyncio.run(run())
