"""A worker replica's delta channel port against strangers (security round 3, R1): connections
that never send their token cannot keep the ingress out. A real worker replica (its engine
scripted) and real ingress muxes over loopback TCP; the strangers connect from another loopback
address, from a thread of their own."""

from __future__ import annotations

import asyncio
import threading
import time

from pagefleet.router.worker_client.delta_mux import ChannelMux, read_deltas
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.replica import delta_channel
from pagefleet.worker.replica.deployment import WorkerReplica
from pagefleet.worker.replica.wire import ChannelOpen, SocketOffer, WorkerRequest, encode_frame
from pagefleet.worker.sampling_params import SamplingParams

from channel_fakes import Call, SteppedEngine, settle, until

STRANGER = "127.0.0.2"  # the ingress connects from 127.0.0.1
CHANNELS = 5  # ingress channels opened, one after another, while the strangers renew theirs


class Strangers:
    """``count`` connections from ``address`` to a port, none sending anything, each renewed every
    second (at times spread over the second) until stopped."""

    def __init__(self, port: int, count: int, address: str = STRANGER) -> None:
        self.port, self.count, self.address = port, count, address
        self.connects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, offset_s: float) -> None:
        await asyncio.sleep(offset_s)
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(self.address, 0))
            except OSError:
                pass
            else:
                self.connects += 1
                try:
                    await asyncio.wait_for(reader.read(1), 1.0)  # until the replica closes it, or renewed
                except (asyncio.TimeoutError, ConnectionError):
                    pass
                writer.close()
            await asyncio.sleep(max(0.0, started + 1.0 - time.monotonic()))

    async def _run(self) -> None:
        await asyncio.gather(*(self._one(i / self.count) for i in range(self.count)))

    def __enter__(self) -> "Strangers":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def test_connections_that_never_send_their_token_keep_no_ingress_out():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine)  # listens on loopback here
        for step in replica.engine.steps:
            step.set()  # every request runs to its end at once
        offer = await replica.channel(ChannelOpen("warm", "local", socket=True)).__anext__()
        unusable: list[str] = []
        carried = 0
        with Strangers(offer.port, 200) as strangers:
            # The strangers hold their slots before the ingress opens its channels (on a loaded
            # machine their thread may take a while to get going).
            await until(lambda: strangers.connects >= 200, timeout_s=60.0)
            connected_first = strangers.connects
            while carried < CHANNELS:
                channel_id = f"ingress-{carried}"  # a new channel each time: a new connection and hello
                mux = ChannelMux(lambda request: Call(replica.channel(request)), channel_id=channel_id,
                                 on_socket_unusable=unusable.append)
                mux.register("first")
                mux.placed("first", "local")
                await until(lambda: mux._connections.get("local") is not None and mux._connections["local"].open
                            or unusable, timeout_s=5.0)
                assert unusable == [] and mux.counters.socket_channels == 1, (unusable, mux.counters)
                q = mux.register("sent")
                assert mux.send(WorkerRequest("sent", [1, 2], SamplingParams(max_tokens=3), ranking=["local"],
                                              channel=channel_id), "local")
                assert [t async for d in read_deltas(q) for t in d.sequences[0].token_ids] == [0, 1, 2]
                for request_id in ("first", "sent"):
                    mux.release(request_id)
                for task in list(mux._readers.values()):
                    task.cancel()
                carried += 1
                await asyncio.sleep(0.2)
            pending_while_attacked = replica._channel_server.pending_hellos
            renewed = strangers.connects - connected_first
        replica._channel_server.close()
        await settle()
        return carried, connected_first, renewed, pending_while_attacked

    carried, connects, renewed, pending = asyncio.run(run())
    assert carried == CHANNELS  # each on its own connection, its request's deltas carried on it
    assert connects >= 200 and renewed > 0  # the strangers held their slots and kept at it
    assert pending <= delta_channel.MAX_PENDING_HELLOS_PER_ADDRESS  # one address held no more than its share


def test_waiting_connections_are_bounded_per_address_and_in_all_oldest_closed_first(monkeypatch):
    monkeypatch.setattr(delta_channel, "MAX_PENDING_HELLOS", 4)
    monkeypatch.setattr(delta_channel, "MAX_PENDING_HELLOS_PER_ADDRESS", 2)

    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        offer = await replica.channel(ChannelOpen("c1", "local", socket=True)).__anext__()
        assert isinstance(offer, SocketOffer) and offer.host == "127.0.0.1"
        server = replica._channel_server

        async def connect(address: str):
            return await asyncio.open_connection(offer.host, offer.port, local_addr=(address, 0))

        async def closed(reader) -> bool:
            return await asyncio.wait_for(reader.read(1), 0.5) == b""

        a1, a2 = await connect("127.0.0.2"), await connect("127.0.0.2")
        await until(lambda: server.pending_hellos == 2)
        a3 = await connect("127.0.0.2")  # its address's third: the address's oldest goes
        assert await closed(a1[0])
        await until(lambda: server.pending_hellos == 2)
        b1, b2 = await connect("127.0.0.3"), await connect("127.0.0.3")
        await until(lambda: server.pending_hellos == 4)
        c1 = await connect("127.0.0.4")  # the fifth in all: the oldest of an address holding the most
        assert await closed(a2[0])
        await until(lambda: server.pending_hellos == 4)
        # a3, b1, b2 and c1 still wait, within their second
        assert {address: len(waiting) for address, waiting in server._hellos.items()} == \
            {"127.0.0.2": 1, "127.0.0.3": 2, "127.0.0.4": 1}
        started = time.monotonic()
        for reader, _ in (a3, b1, b2, c1):  # the rest are closed once HELLO_TIMEOUT_S passes without a token
            assert await asyncio.wait_for(reader.read(1), 3.0) == b""
        assert time.monotonic() - started < delta_channel.HELLO_TIMEOUT_S + 0.5
        assert server.pending_hellos == 0 and server._hellos == {}
        reader, writer = await asyncio.open_connection(offer.host, offer.port)
        writer.write(offer.token)  # the offer itself still works
        assert await asyncio.wait_for(reader.readexactly(len(encode_frame([]))), 2.0) == encode_frame([])
        for _, w in (a1, a2, a3, b1, b2, c1, (reader, writer)):
            w.close()
        server.close()

    asyncio.run(run())


def test_a_caller_on_the_replicas_node_is_offered_loopback_and_one_elsewhere_the_nodes_address(monkeypatch):
    from pagefleet.worker.replica import deployment

    monkeypatch.delenv(deployment.CHANNEL_HOST_ENV, raising=False)
    monkeypatch.setattr(deployment, "_node_ip", lambda: "127.0.0.3")  # stands for the node's address

    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine)
        replica._node_id = "node-a"
        here = await replica.channel(ChannelOpen("c1", "local", socket=True, node_id="node-a")).__anext__()
        elsewhere = await replica.channel(ChannelOpen("c2", "local", socket=True, node_id="node-b")).__anext__()
        unknown = await replica.channel(ChannelOpen("c3", "local", socket=True)).__anext__()
        replica._channel_server.close()
        return here, elsewhere, unknown

    here, elsewhere, unknown = asyncio.run(run())
    assert here.host == "127.0.0.1"
    assert (elsewhere.host, unknown.host) == ("127.0.0.3", "127.0.0.3")  # a caller that does not say: as before
    assert elsewhere.port == unknown.port != here.port  # one socket per address


def test_the_ingress_says_its_node_when_it_opens_a_channel():
    opened: list[ChannelOpen] = []
    mux = ChannelMux(lambda request: opened.append(request), channel_id="c1", node_id="node-a")

    async def run():
        mux.register("a")
        mux.placed("a", "w0")
        await until(lambda: opened)
        mux.release("a")
        for task in list(mux._readers.values()):
            task.cancel()
        await settle()

    asyncio.run(run())
    assert opened[0] == ChannelOpen("c1", "w0", socket=True, node_id="node-a")
