"""The ingress's worker client over a real worker replica (its engine scripted): requests go
through Serve (here, direct calls standing in for the handle), their output comes back on the
replica's channel connection over loopback TCP."""

from __future__ import annotations

import asyncio

from pagefleet.router.ingress import HandleWorkerClient
from pagefleet.router.openai.service import Job
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.replica.deployment import WorkerReplica
from pagefleet.worker.replica.wire import ChannelOpen, decode_batch
from pagefleet.worker.sampling_params import SamplingParams

from channel_fakes import ReplicaHandle, SteppedEngine, until


def _client(replica: WorkerReplica):
    """(handle, client, tokens): ``tokens(request_id)`` is the output of one request ranked for the replica."""
    handle = ReplicaHandle(replica)
    client = HandleWorkerClient(handle)

    async def tokens(request_id: str) -> list[int]:
        job = Job(request_id, [1, 2], SamplingParams(max_tokens=4), ranking=["local"])
        return [t async for d in client.generate(job) for t in d.sequences[0].token_ids]

    return handle, client, tokens


async def _close(replica: WorkerReplica, client: HandleWorkerClient) -> None:
    replica._channel_server.close()
    for task in list(client.mux._readers.values()):
        task.cancel()
    await asyncio.sleep(0)


def test_requests_go_through_serve_ranked_and_their_output_comes_on_the_channel_connection():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        handle, client, tokens = _client(replica)
        first = asyncio.ensure_future(tokens("first"))  # no reader yet: its deltas follow on its own stream
        await until(lambda: replica._channels.get(client.mux.channel_id) is not None
                    and replica._channels[client.mux.channel_id].attached)
        for step in replica.engine.steps:
            step.set()
        assert await first == [0, 1, 2, 3]
        batches = client.mux.counters.batches
        assert await tokens("second") == [0, 1, 2, 3]
        assert handle.generate_calls == [("first", ["local"]), ("second", ["local"])]
        assert client.mux.counters.socket_channels == 1
        assert client.mux.counters.batches > batches and client.mux.counters.unclaimed == 0
        assert replica._channels[client.mux.channel_id].requests == 0
        await _close(replica, client)

    asyncio.run(run())


def test_a_channel_connection_that_breaks_mid_request_loses_no_output():
    """The replica keeps what the broken connection did not carry; the mux connects again and
    takes it, so the request finishes with every token, once."""

    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        handle, client, tokens = _client(replica)
        warm = asyncio.ensure_future(tokens("warm"))  # opens the channel connection
        await until(lambda: client.mux.counters.socket_channels == 1)
        for step in replica.engine.steps:
            step.set()
        assert await warm == [0, 1, 2, 3]
        replica.engine.steps = [asyncio.Event() for _ in range(8)]
        request = asyncio.ensure_future(tokens("r"))
        await until(lambda: replica.engine.started[-1:] == ["r"])
        deltas = client.mux.counters.deltas
        replica.engine.steps[0].set()
        await until(lambda: client.mux.counters.deltas == deltas + 1)  # r's first token arrived
        # Another reader takes the channel over (as a reconnecting caller does): the replica ends
        # the connection's sending side and closes it, mid-request.
        channel = replica._channels[client.mux.channel_id]
        intruder = replica.channel(ChannelOpen(client.mux.channel_id, "local"))
        assert decode_batch(await intruder.__anext__()) == []
        replica.engine.steps[1].set()  # a token the intruder never takes waits on the replica
        await until(lambda: client.mux.counters.socket_channels == 2)  # the mux connected again
        await intruder.aclose()
        assert channel.attached
        replica.engine.steps[2].set()
        replica.engine.steps[3].set()
        assert await asyncio.wait_for(request, 5.0) == [0, 1, 2, 3]
        assert client.mux.counters.socket_channels == 2
        assert [call for call, _ in handle.generate_calls] == ["warm", "r"]  # nothing was sent again
        await _close(replica, client)

    asyncio.run(run())


def test_a_jobs_priority_reaches_the_routing_clients_admission():
    seen = []

    class RoutingClient:
        async def route(self, *args):
            seen.append(args)
            return None  # no worker known yet: sent without a ranking

    async def run():
        client = HandleWorkerClient(ReplicaHandle(None), kv=RoutingClient())
        return await client.route(Job("r", [1, 2], SamplingParams(max_tokens=4), priority=-4))

    assert asyncio.run(run()) is None
    assert seen == [("r", b"", 2, 4, 1, -4)]  # id, block hashes, prompt length, max_tokens, n, priority
