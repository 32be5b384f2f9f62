"""Delta channels: a worker replica puts every delta of a caller's requests on one channel per
(caller, replica), one item per step, on a TCP connection or a Serve stream, and the ingress
hands each delta to its request."""

from __future__ import annotations

import asyncio
import pickle
import socket
import time
from types import SimpleNamespace

import msgspec
import pytest

from pagefleet.router.routing.request_router import KVRouter, RoundRobinRouter
from pagefleet.router.worker_client.delta_mux import (
    SOCKET_RETRY_S,
    ChannelMux,
    LostOutputError,
    _FrameReader,
    read_deltas,
)
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.replica.delta_channel import TOKEN_BYTES, DeltaChannel
from pagefleet.worker.replica.deployment import WorkerReplica
from pagefleet.worker.replica.wire import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    ChannelOpen,
    Ended,
    Placed,
    SocketOffer,
    WorkerRequest,
    decode_batch,
    encode_batch,
    encode_frame,
)
from pagefleet.worker.sampling_params import SamplingParams

from channel_fakes import Call, SteppedEngine, delta, settle, until


def _request(request_id: str, max_tokens: int, channel: str | None = "c1") -> WorkerRequest:
    return WorkerRequest(request_id, [1, 2], SamplingParams(max_tokens=max_tokens), channel=channel)


def test_one_item_per_step_carries_every_requests_delta():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine)
        channel = replica.channel(ChannelOpen("c1", "local"))
        assert decode_batch(await channel.__anext__()) == []  # attached
        a, b = replica.generate(_request("a", 2)), replica.generate(_request("b", 2))
        assert (await a.__anext__(), await b.__anext__()) == (Placed("local"), Placed("local"))
        ends = [asyncio.ensure_future(a.__anext__()), asyncio.ensure_future(b.__anext__())]
        items = []
        for step in range(2):
            await settle()
            replica.engine.steps[step].set()
            items.append(decode_batch(await channel.__anext__()))
        assert [[(d.request_id, d.sequences[0].token_ids) for d in item] for item in items] == \
            [[("a", [0]), ("b", [0])], [("a", [1]), ("b", [1])]]
        assert await asyncio.gather(*ends) == [Ended(2), Ended(2)]
        for request_stream in (a, b):  # Serve reads each stream to its end
            with pytest.raises(StopAsyncIteration):
                await request_stream.__anext__()
        assert replica._channels["c1"].requests == 0
        await channel.aclose()
        assert replica._channels == {}  # no reader, no request: nothing kept

    asyncio.run(run())


def test_without_a_channel_the_request_stream_carries_its_deltas():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine)
        for step in replica.engine.steps:
            step.set()
        return [d.sequences[0].token_ids async for d in replica.generate(_request("a", 3, channel=None))]

    assert asyncio.run(run()) == [[0], [1], [2]]


def test_a_cancelled_channel_request_is_aborted_at_once_and_leaves_nothing():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine)
        channel = replica.channel(ChannelOpen("c1", "local"))
        assert decode_batch(await channel.__anext__()) == []
        gen = replica.generate(_request("a", 3))
        assert await gen.__anext__() == Placed("local")
        replica.engine.steps[0].set()
        pending = asyncio.ensure_future(gen.__anext__())
        await settle()
        assert replica._channels["c1"].pending[0].sequences[0].token_ids == [0]  # queued for the reader
        pending.cancel()  # what Serve does when the ingress cancels the request
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert replica.engine.closed == ["a"] and replica._channels["c1"].requests == 0
        await channel.aclose()
        return replica

    replica = asyncio.run(run())
    assert replica._channels == {}


def test_the_engine_takes_a_channel_request_while_its_placed_is_on_the_way():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine)
        channel = replica.channel(ChannelOpen("c1", "local"))
        assert decode_batch(await channel.__anext__()) == []
        gen = replica.generate(_request("a", 3))
        assert await gen.__anext__() == Placed("local")
        await settle()  # Serve is sending the Placed: nothing asks for the next item yet
        assert replica.engine.started == ["a"] and replica.engine.closed == []
        await gen.aclose()  # the caller went away before it asked for more
        assert replica.engine.closed == ["a"] and replica._channels["c1"].requests == 0
        await channel.aclose()
        assert replica._channels == {}

    asyncio.run(run())


def test_a_request_that_starts_with_no_reader_attached_streams_its_own_deltas():
    # the caller's first request there, or a channel that cannot attach while the replica is full
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine)
        for step in replica.engine.steps:
            step.set()
        items = [item async for item in replica.generate(_request("a", 2))]
        return replica, items

    replica, items = asyncio.run(run())
    assert items[0] == Placed("local", on_channel=False)
    assert [d.sequences[0].token_ids for d in items[1:]] == [[0], [1]] and items[-1].finished
    assert replica._channels == {}


def test_a_channel_meant_for_another_replica_is_refused():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine)
        await replica.channel(ChannelOpen("c1", "other-replica")).__anext__()

    with pytest.raises(ValueError, match="for replica other-replica, not local"):
        asyncio.run(run())


def test_a_new_reader_takes_over_and_gets_everything_not_yet_taken():
    async def run():
        channel = DeltaChannel()
        first = channel.batches()
        assert decode_batch(await first.__anext__()) == []
        channel.put(delta("a", 0))
        assert decode_batch(await first.__anext__()) == [delta("a", 0)]
        channel.put(delta("a", 1))  # the first reader's stream broke before it took this one
        second = channel.batches()
        assert decode_batch(await second.__anext__()) == []
        with pytest.raises(StopAsyncIteration):  # the old reader ends at its next wake-up
            await first.__anext__()
        channel.put(delta("a", 2))
        assert decode_batch(await second.__anext__()) == [delta("a", 1), delta("a", 2)]
        assert channel.attached

    asyncio.run(run())


def test_a_channel_with_no_request_ends_its_stream_and_one_with_requests_does_not():
    async def run():
        channel = DeltaChannel()
        idle = channel.batches(idle_close_s=0.05)
        assert decode_batch(await idle.__anext__()) == []
        with pytest.raises(StopAsyncIteration):  # nothing ran for 50 ms: the stream ends
            await idle.__anext__()
        assert not channel.attached
        channel.requests = 1
        busy = channel.batches(idle_close_s=0.05)
        assert decode_batch(await busy.__anext__()) == []
        waiting = asyncio.ensure_future(busy.__anext__())
        await asyncio.sleep(0.15)
        assert not waiting.done()  # a request runs there: the stream stays, however long its step
        channel.put(delta("a", 0))
        assert decode_batch(await waiting) == [delta("a", 0)]

    asyncio.run(run())


def test_a_channel_whose_last_request_ended_after_its_last_delta_was_taken_ends_its_stream_once_idle():
    """The reader took the last delta while its request still counted (the request ends after its
    final delta is put), so it was waiting with no idle limit: the request's end starts the idle
    time. Otherwise the channel never ends, nor the ``channel`` call that Serve's graceful shutdown
    of the replica waits for (a scale-down then runs to its timeout and kills the replica)."""
    async def run():
        channel = DeltaChannel()
        channel.requests = 1
        stream = channel.batches(idle_close_s=0.05)
        assert decode_batch(await stream.__anext__()) == []
        channel.put(delta("a", 0))
        assert decode_batch(await stream.__anext__()) == [delta("a", 0)]
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        channel.requests -= 1
        started = time.monotonic()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, 1.0)
        assert time.monotonic() - started >= 0.05  # idle for idle_close_s from the request's end
        assert not channel.attached

    asyncio.run(run())


class _Stream:
    """A channel stream stand-in: an empty batch once attached, then what the test puts."""

    def __init__(self):
        self.items: asyncio.Queue = asyncio.Queue()
        self.items.put_nowait(encode_batch([]))
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.items.get()
        if item is None:  # the replica ended the stream (an idle channel)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def _mux():
    opened: list[tuple[ChannelOpen, _Stream]] = []

    def open_channel(request: ChannelOpen) -> _Stream:
        opened.append((request, _Stream()))
        return opened[-1][1]

    return ChannelMux(open_channel, channel_id="c1", sockets=False), opened


def test_the_mux_opens_one_channel_per_replica_and_routes_each_delta_to_its_request():
    async def run():
        mux, opened = _mux()
        qa, qb = mux.register("a"), mux.register("b")
        mux.placed("a", "w0")
        mux.placed("b", "w0")
        await settle()
        assert [request for request, _ in opened] == [ChannelOpen("c1", "w0")]
        opened[0][1].items.put_nowait(encode_batch([delta("a", 0), delta("b", 0), delta("gone", 0)]))
        await settle()
        assert (qa.get_nowait(), qb.get_nowait()) == (delta("a", 0), delta("b", 0))
        assert (mux.counters.batches, mux.counters.deltas, mux.counters.unclaimed) == (2, 3, 1)  # the first: attached
        with pytest.raises(ValueError, match="already running"):
            mux.register("a")

    asyncio.run(run())


def test_deltas_before_placed_are_kept_and_a_failed_attempts_late_deltas_are_not():
    async def run():
        mux, opened = _mux()
        mux.register("x")
        mux.placed("x", "w0")  # w0's channel is read for another request's sake
        q = mux.register("a")
        await settle()
        w0 = opened[0][1]
        w0.items.put_nowait(encode_batch([delta("a", 0)]))  # before a's Placed: from wherever a runs
        await settle()
        assert q.get_nowait() == delta("a", 0)
        mux.placed("a", "w0")
        mux.release("a")  # w0 failed; the next send has an id of its own (the ingress's "a#2")
        q = mux.register("a#2")
        w0.items.put_nowait(encode_batch([delta("a", 1)]))  # w0's late delta, before the new send's Placed
        mux.placed("a#2", "w1")
        await settle()
        opened[1][1].items.put_nowait(encode_batch([delta("a#2", 7)]))
        w0.items.put_nowait(encode_batch([delta("a", 2)]))  # and after it
        await settle()
        assert q.get_nowait() == delta("a#2", 7) and q.empty()
        assert mux.counters.unclaimed == 2

    asyncio.run(run())


def test_a_broken_channel_is_opened_again_while_requests_run_there_and_not_after():
    async def run():
        mux, opened = _mux()
        q = mux.register("a")
        mux.placed("a", "w0")
        await settle()
        opened[0][1].items.put_nowait(ConnectionError("stream broke"))
        await asyncio.sleep(0.3)  # the reopen backoff
        assert len(opened) == 2 and opened[0][1].cancelled
        opened[1][1].items.put_nowait(encode_batch([delta("a", 0, finished=True)]))
        await settle()
        assert q.get_nowait() == delta("a", 0, finished=True)
        mux.release("a")
        opened[1][1].items.put_nowait(ConnectionError("the replica died"))
        await asyncio.sleep(0.3)
        assert len(opened) == 2 and mux._readers == {}  # nothing runs there: not opened again

    asyncio.run(run())


def test_a_channel_the_replica_closed_is_opened_again_at_once_for_a_request_placed_there():
    async def run():
        mux, opened = _mux()
        mux.register("a")
        mux.placed("a", "w0")
        await settle()
        opened[0][1].items.put_nowait(None)
        await settle()
        assert len(opened) == 2 and mux._readers  # no backoff: nothing broke
        mux.release("a")
        opened[1][1].items.put_nowait(None)
        await settle()
        assert len(opened) == 2 and mux._readers == {}

    asyncio.run(run())


def test_read_deltas_merges_what_the_reader_missed_and_stops_at_the_finished_one():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        for item in (delta("a", 0), delta("a", 1), Ended(3)):
            q.put_nowait(item)
        deltas = read_deltas(q)
        got = [await deltas.__anext__()]
        q.put_nowait(delta("a", 2, finished=True))
        got += [d async for d in deltas]
        return [(d.sequences[0].token_ids, d.finished) for d in got]

    assert asyncio.run(run()) == [([0, 1], False), ([2], True)]


def test_read_deltas_raises_the_requests_error_after_its_deltas():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(delta("a", 0))
        q.put_nowait(RuntimeError("engine died"))
        got = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for d in read_deltas(q):
                got.append(d.sequences[0].token_ids)
        return got

    assert asyncio.run(run()) == [[0]]


def test_read_deltas_gives_up_on_deltas_the_replica_sent_that_never_came():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(delta("a", 0))
        q.put_nowait(Ended(2))
        async for _ in read_deltas(q, lost_output_timeout_s=0.05):
            pass

    with pytest.raises(LostOutputError, match="sent 2 deltas, 1 arrived"):
        asyncio.run(run())


def _socket_mux(replica: WorkerReplica, calls: list[ChannelOpen]) -> ChannelMux:
    def open_channel(request: ChannelOpen) -> Call:
        calls.append(request)
        return Call(replica.channel(request))

    return ChannelMux(open_channel, channel_id="c1")


def test_a_socket_channel_carries_each_steps_deltas_to_their_requests():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        calls: list[ChannelOpen] = []
        mux = _socket_mux(replica, calls)
        qa, qb = mux.register("a"), mux.register("b")
        mux.placed("a", "local")  # the reader starts: the call offers a socket, the mux connects
        await until(lambda: "c1" in replica._channels and replica._channels["c1"].attached)
        assert calls == [ChannelOpen("c1", "local", socket=True)]
        a, b = replica.generate(_request("a", 2)), replica.generate(_request("b", 2))
        assert (await a.__anext__(), await b.__anext__()) == (Placed("local"), Placed("local"))
        mux.placed("b", "local")
        ends = [asyncio.ensure_future(a.__anext__()), asyncio.ensure_future(b.__anext__())]
        for step in range(2):
            await settle()
            replica.engine.steps[step].set()
            await until(lambda: qa.qsize() == qb.qsize() == step + 1)
        assert [qa.get_nowait().sequences[0].token_ids for _ in range(2)] == [[0], [1]]
        assert [qb.get_nowait().sequences[0].token_ids for _ in range(2)] == [[0], [1]]
        assert await asyncio.gather(*ends) == [Ended(2), Ended(2)]
        # one connection; frames: [] on attaching, then one per step carrying both requests' deltas
        assert (mux.counters.channels_opened, mux.counters.socket_channels) == (1, 1)
        assert (mux.counters.batches, mux.counters.deltas, mux.counters.unclaimed) == (3, 4, 0)
        mux.release("a")
        mux.release("b")
        replica._channel_server.close()
        for task in list(mux._readers.values()):
            task.cancel()

    asyncio.run(run())


def test_a_socket_offer_is_claimed_once_and_a_wrong_token_gets_nothing():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        call = replica.channel(ChannelOpen("c1", "local", socket=True))
        offer = await call.__anext__()
        assert isinstance(offer, SocketOffer) and len(offer.token) == TOKEN_BYTES
        # The offer is the call's one item; the call lasts until the connection that claims it ends.
        call_ended = asyncio.ensure_future(call.__anext__())

        async def claim(token: bytes) -> bytes:
            reader, writer = await asyncio.open_connection(offer.host, offer.port)
            writer.write(token)
            try:
                return await asyncio.wait_for(reader.read(1 << 16), 2.0)
            finally:
                writer.close()

        assert await claim(bytes(TOKEN_BYTES)) == b""  # closed, nothing sent
        assert replica._channels == {}
        assert not call_ended.done()
        first = await claim(offer.token)
        assert first == encode_frame([])  # attached: the channel's first batch
        with pytest.raises(StopAsyncIteration):  # that connection is closed: the call ends
            await asyncio.wait_for(call_ended, 2.0)
        assert await claim(offer.token) == b""  # used once already
        replica._channel_server.close()

    asyncio.run(run())


def _frame(body: bytes) -> bytes:
    return FRAME_HEADER.pack(len(body)) + body


@pytest.mark.parametrize("frame", [
    _frame(b"x"),  # not msgpack
    _frame(pickle.dumps([WorkerRequest("a", [1], SamplingParams())])),  # pickled: never decoded as such
    _frame(msgspec.msgpack.encode([{"request_id": "a", "prompt_token_ids": [1], "params": {"n": 0}}])),  # n < 1
    _frame(msgspec.msgpack.encode([["a", "b"]])),  # an abort of two ids
    FRAME_HEADER.pack(MAX_FRAME_BYTES + 1),  # longer than any frame of ours
], ids=["not_msgpack", "pickle", "invalid_params", "bad_abort", "too_long"])
def test_a_peer_that_sends_a_frame_that_is_not_requests_is_closed_and_nothing_runs(frame):
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        replica._channel("c1").requests = 1  # a request runs there: the channel would not end on its own
        offer = await replica.channel(ChannelOpen("c1", "local", socket=True)).__anext__()
        reader, writer = await asyncio.open_connection(offer.host, offer.port)
        writer.write(offer.token)
        assert await asyncio.wait_for(reader.readexactly(len(encode_frame([]))), 2.0) == encode_frame([])
        assert replica._channels["c1"].attached
        writer.write(frame)
        assert await asyncio.wait_for(reader.read(1 << 16), 2.0) == b""  # closed
        await until(lambda: not replica._channels["c1"].attached)
        assert replica.engine.started == [] and replica.seats.taken == 0
        writer.close()
        replica._channel_server.close()

    asyncio.run(run())


def test_a_replica_whose_socket_cannot_be_reached_gets_serve_stream_channels():
    async def run():
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            closed_port = s.getsockname()[1]
        opened: list[tuple[ChannelOpen, object]] = []

        def open_channel(request: ChannelOpen):
            if request.socket:
                call = _Stream()
                call.items.get_nowait()
                call.items.put_nowait(SocketOffer("127.0.0.1", closed_port, bytes(TOKEN_BYTES)))
            else:
                call = _Stream()
            opened.append((request, call))
            return call

        unusable: list[str] = []
        mux = ChannelMux(open_channel, channel_id="c1", on_socket_unusable=unusable.append)
        q = mux.register("a")
        mux.placed("a", "w0")
        await until(lambda: len(opened) == 2)
        assert unusable == ["connect"]  # the ingress's metric of sockets it could not use
        assert [request for request, _ in opened] == [ChannelOpen("c1", "w0", socket=True),
                                                       ChannelOpen("c1", "w0", socket=False)]
        opened[1][1].items.put_nowait(encode_batch([delta("a", 0)]))
        assert await asyncio.wait_for(q.get(), 2.0) == delta("a", 0)
        assert list(mux._no_socket) == ["w0"] and mux.counters.socket_channels == 0
        assert mux._no_socket["w0"] > time.monotonic() + SOCKET_RETRY_S - 5  # tried again later, not never
        mux.release("a")
        opened[1][1].items.put_nowait(None)

    asyncio.run(run())


def test_a_replica_that_cannot_listen_serves_the_channel_on_its_stream():
    async def run():
        # an address of no interface here (TEST-NET-3): binding it fails
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="203.0.113.1")
        call = replica.channel(ChannelOpen("c1", "local", socket=True))
        assert decode_batch(await call.__anext__()) == []  # attached on this stream instead of an offer
        assert replica._channels["c1"].attached
        await call.aclose()

    asyncio.run(run())


def test_the_frame_reader_takes_frames_however_the_bytes_arrive():
    async def run():
        got: list[list] = []
        reader = _FrameReader(b"t" * TOKEN_BYTES, lambda body: got.append(decode_batch(body)))
        sent = SimpleNamespace(data=b"")
        reader.connection_made(SimpleNamespace(write=lambda b: setattr(sent, "data", sent.data + b)))
        assert sent.data == b"t" * TOKEN_BYTES
        frames = encode_frame([]) + encode_frame([delta("a", 0)]) + encode_frame([delta("a", 1), delta("b", 1)])
        for i in range(0, len(frames), 7):  # in 7-byte pieces: headers and bodies split anywhere
            reader.data_received(frames[i:i + 7])
        assert got == [[], [delta("a", 0)], [delta("a", 1), delta("b", 1)]]
        reader.data_received(frames)  # all at once
        assert len(got) == 6 and reader.frames == 6
        reader.connection_lost(None)
        assert reader.done.result() is True  # frames came: the replica had accepted the token

    asyncio.run(run())


@pytest.mark.parametrize("frame", [FRAME_HEADER.pack(3) + b"abc",  # not msgpack of a delta list
                                   FRAME_HEADER.pack(3),  # a header alone: it waits for the body
                                   FRAME_HEADER.pack(MAX_FRAME_BYTES + 1)])  # longer than any of ours
def test_the_frame_reader_drops_a_connection_that_sends_what_is_not_ours(frame):
    async def run():
        got: list[list] = []
        reader = _FrameReader(b"t" * TOKEN_BYTES, lambda body: got.append(decode_batch(body)))
        aborted = []
        reader.connection_made(SimpleNamespace(write=lambda b: None, abort=lambda: aborted.append(True)))
        reader.data_received(frame)
        return got, aborted, reader.done

    got, aborted, done = asyncio.run(run())
    assert got == []
    if frame == FRAME_HEADER.pack(3):
        assert aborted == [] and not done.done()
    else:
        assert aborted == [True]

    asyncio.run(run())


def _replica(unique_id: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id))


@pytest.mark.parametrize("router_class", [KVRouter, RoundRobinRouter])
def test_the_request_routers_send_a_channel_to_its_replica_alone(router_class):
    router = object.__new__(router_class)  # choose_replicas reads nothing else for a channel
    candidates = [_replica("w0"), _replica("w1"), _replica("w2")]
    pending = SimpleNamespace(args=[ChannelOpen("c1", "w1")], routing_context=SimpleNamespace(should_backoff=False))
    assert asyncio.run(router.choose_replicas(candidates, pending)) == [[candidates[1]]]
    pending = SimpleNamespace(args=[ChannelOpen("c1", "w9")], routing_context=SimpleNamespace(should_backoff=False))
    assert asyncio.run(router.choose_replicas(candidates, pending)) == []  # gone: no replica, never another
    # and Serve backs off before asking again (it would otherwise ask in a loop that never yields)
    assert pending.routing_context.should_backoff is True
