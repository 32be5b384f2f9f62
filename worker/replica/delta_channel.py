"""A worker replica's side of one caller's delta channel.

Each caller (an ingress replica) holds one long-lived channel per replica, and every delta of
its requests goes on it: what the engine produced since the reader last took is one item (an
encoded list of deltas, oldest first: ``wire.encode_batch``), whatever the number of requests.
Each Serve stream item costs CPU in several processes, so one item per request per step would
spend much of a small machine on delivery.

The channel's reader is a plain TCP connection from the caller where it can reach the replica
(``ChannelServer``), which costs the receiver far less per item than a Serve stream; where the
caller cannot connect, the ``channel`` call's own Serve stream is the reader. Either way the
items are the same bytes. Once connected, the caller may send requests on the same connection
instead of through Serve (``wire``): they run as long as their connection does, and the
``channel`` call that handed out the connection's offer lasts as long as the connection, so
Serve's graceful shutdown of the replica waits for them as it waits for its own calls.
docs/architecture.md draws the path; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from typing import AsyncIterator, Callable

import msgspec

from pagefleet.worker.aio import cancel_and_wait
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.replica.wire import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    Abort,
    Notice,
    SocketOffer,
    WorkerRequest,
    decode_commands,
    encode_batch,
)

logger = logging.getLogger(__name__)

# A channel with no request for this long ends its stream.
IDLE_CLOSE_S = 5.0
TOKEN_BYTES = 16
# An offer not claimed within this long is void; a connection that sends no token this long is closed.
OFFER_TTL_S = 30.0
HELLO_TIMEOUT_S = 1.0
# Connections that have not sent their token yet, at most, from one source address and in all. Past
# either bound a newcomer closes the oldest waiting one (of its own address, or of the address
# holding the most): a peer of ours sends its token as it connects, so it is read long before a
# stranger's flood, however renewed, reaches it; and one address never holds every slot.
MAX_PENDING_HELLOS = 64
MAX_PENDING_HELLOS_PER_ADDRESS = 8
LOOPBACK = "127.0.0.1"


def keep_alive(sock: socket.socket | None) -> None:
    """Probe an idle connection so one to a peer that vanished (no FIN) errors within ~30 s."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class DeltaChannel:
    """Deltas waiting for the reader. One reader at a time: a new one takes over (the old one
    ends at its next wake-up), so a caller that lost its stream can open it again and get every
    delta not yet taken. Deltas queue while no reader is attached and requests still run."""

    def __init__(self) -> None:
        self.pending: list[RequestOutputDelta | Notice] = []
        self._ready = asyncio.Event()
        self._reader: object | None = None
        self._requests = 0

    @property
    def requests(self) -> int:
        """Requests on this channel still running."""
        return self._requests

    @requests.setter
    def requests(self, n: int) -> None:
        self._requests = n
        if n == 0:
            # The reader may be waiting with no idle limit (a request ran when it last woke):
            # its idle time starts now.
            self._ready.set()

    @property
    def attached(self) -> bool:
        return self._reader is not None

    @property
    def unused(self) -> bool:
        """No reader and no request running: whatever is still pending has no one to go to."""
        return self._reader is None and self.requests == 0

    def put(self, delta: RequestOutputDelta | Notice) -> None:
        self.pending.append(delta)
        self._ready.set()

    async def batches(self, idle_close_s: float = IDLE_CLOSE_S) -> AsyncIterator[bytes]:
        """The reader's stream of encoded lists: an empty one at once (attached), then one per wake-up.
        It ends after ``idle_close_s`` with no request running and nothing pending: a replica
        that Serve stops then waits for no call of its own (the caller opens the channel again
        for its next request)."""
        token = object()
        self._reader = token
        self._ready.set()  # wakes a reader this one replaces, so it ends
        try:
            yield encode_batch([])
            while True:
                if self.requests or self.pending:
                    await self._ready.wait()
                else:
                    try:
                        await asyncio.wait_for(self._ready.wait(), idle_close_s)
                    except asyncio.TimeoutError:
                        if not self.requests and not self.pending:
                            return
                        continue
                if self._reader is not token:
                    return
                self._ready.clear()
                if self.pending:
                    batch, self.pending = self.pending, []
                    yield encode_batch(batch)
        finally:
            if self._reader is token:
                self._reader = None


class Offered:
    """An offer as its ``channel`` call sees it: ``until_done`` returns once the connection that
    claimed it has ended, or when nobody claimed it in time."""

    def __init__(self, channel_id: str, valid_until: float) -> None:
        self.channel_id = channel_id
        self.valid_until = valid_until
        self.claimed = asyncio.Event()
        self.ended = asyncio.Event()

    async def until_done(self) -> None:
        try:
            await asyncio.wait_for(self.claimed.wait(), max(0.0, self.valid_until - time.monotonic()))
        except asyncio.TimeoutError:
            return
        await self.ended.wait()


# What a replica does with the requests and aborts a connection sends: (channel id, the frame's
# commands, that connection's running requests by id).
OnCommands = Callable[[str, "list[WorkerRequest | Abort]", "dict[str, asyncio.Task]"], None]


class ChannelServer:
    """A replica's listening sockets for its callers' delta channels. ``offer(channel_id, host)``
    makes a one-time token for that channel, claimed on the socket listening on ``host`` (started
    with the first offer there, on a port the system picks: loopback for a caller on the replica's
    node, the node's address for one elsewhere). A connection that sends it within ``HELLO_TIMEOUT_S`` becomes
    the channel's reader (``DeltaChannel.batches``, so it takes over from any other) and gets every
    batch as one frame, the empty one first. A peer without a token gets nothing and is closed. One
    with a token (handed out only by the replica's ``channel`` call, through Serve) may send frames
    of requests and aborts (``wire.encode_commands``), which go to ``on_commands`` with the tasks
    that connection's requests run in; a frame that is not one closes the connection. When the
    connection ends, its requests still running are cancelled (their requests aborted)."""

    def __init__(self, channel_for: Callable[[str], DeltaChannel], detached: Callable[[str], None],
                 on_commands: OnCommands | None = None) -> None:
        self._channel_for = channel_for
        self._detached = detached
        self._on_commands = on_commands
        self._offers: dict[bytes, Offered] = {}  # token -> offer not yet claimed
        self._servers: dict[str, asyncio.AbstractServer] = {}  # by the host it listens on
        self._starting = asyncio.Lock()  # two first offers at once start one server
        # connections that have not sent their token yet, oldest first, by source address
        self._hellos: dict[str, list[asyncio.StreamWriter]] = {}

    @property
    def pending_hellos(self) -> int:
        return sum(map(len, self._hellos.values()))

    def port(self, host: str) -> int | None:
        server = self._servers.get(host)
        return None if server is None else server.sockets[0].getsockname()[1]

    async def offer(self, channel_id: str, host: str) -> tuple[SocketOffer, Offered]:
        """An offer claimed on ``host``'s socket (OSError: this replica cannot listen there)."""
        if host not in self._servers:
            async with self._starting:
                if host not in self._servers:
                    self._servers[host] = await asyncio.start_server(self._serve, host, 0)
        now = time.monotonic()
        self._offers = {t: o for t, o in self._offers.items() if o.valid_until > now}
        token = secrets.token_bytes(TOKEN_BYTES)
        offered = self._offers[token] = Offered(channel_id, now + OFFER_TTL_S)
        return SocketOffer(host, self.port(host), token), offered

    def _await_hello(self, address: str, writer: asyncio.StreamWriter) -> None:
        """Counts a connection waiting for its token, closing the oldest waiting one where a
        bound is reached (its wait then ends at once)."""
        waiting = self._hellos.setdefault(address, [])
        if len(waiting) >= MAX_PENDING_HELLOS_PER_ADDRESS:
            waiting.pop(0).close()
        elif self.pending_hellos >= MAX_PENDING_HELLOS:
            max(self._hellos.values(), key=len).pop(0).close()
        waiting.append(writer)

    def _hello_ended(self, address: str, writer: asyncio.StreamWriter) -> None:
        waiting = self._hellos.get(address, [])
        if writer in waiting:
            waiting.remove(writer)
        if not waiting:
            self._hellos.pop(address, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else ""
        try:
            self._await_hello(address, writer)
            try:
                token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HELLO_TIMEOUT_S)
            finally:
                self._hello_ended(address, writer)
            offered = self._offers.pop(token, None)
            if offered is None or time.monotonic() > offered.valid_until:
                return
            offered.claimed.set()
            keep_alive(writer.get_extra_info("socket"))  # a caller that vanished ends its requests here too
            running: dict[str, asyncio.Task] = {}
            sending = asyncio.ensure_future(self._send_batches(offered.channel_id, writer))
            receiving = asyncio.ensure_future(self._receive_commands(offered.channel_id, reader, running))
            try:  # until the channel ends here (idle, or another reader took over) or the peer leaves
                await asyncio.wait((sending, receiving), return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost = set(running)  # their tasks leave ``running`` as they end
                await cancel_and_wait(sending, receiving, *running.values())
                offered.ended.set()
                if lost:  # what they left on the channel goes to no one (a retry may come back here)
                    channel = self._channel_for(offered.channel_id)
                    channel.pending = [d for d in channel.pending if d.request_id not in lost]
                    self._detached(offered.channel_id)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.debug("delta channel connection ended: %s", type(e).__name__)
        finally:
            writer.close()

    async def _send_batches(self, channel_id: str, writer: asyncio.StreamWriter) -> None:
        batches = self._channel_for(channel_id).batches()
        try:
            async for body in batches:
                writer.write(FRAME_HEADER.pack(len(body)) + body)
                await writer.drain()
        except ConnectionError as e:
            logger.debug("delta channel connection broke: %s", type(e).__name__)
        finally:
            await batches.aclose()  # detaches now, not when collected
            self._detached(channel_id)

    async def _receive_commands(self, channel_id: str, reader: asyncio.StreamReader,
                                running: dict[str, asyncio.Task]) -> None:
        """Until the peer closes its side, or sends what is not a frame of commands."""
        try:
            while True:
                (length,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
                if length > MAX_FRAME_BYTES or self._on_commands is None:
                    logger.warning("delta channel %s: closing a connection that sent what it may not", channel_id)
                    return
                commands = decode_commands(await reader.readexactly(length))
                self._on_commands(channel_id, commands, running)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        except (msgspec.DecodeError, msgspec.ValidationError) as e:  # not a peer of ours
            logger.warning("delta channel %s: closing a connection that sent a frame that is not commands: %s",
                           channel_id, e)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
