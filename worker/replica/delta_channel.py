"""A worker replica's side of one caller's delta channel.

Serve streams cost about as much CPU per item as the engine spends on a token (Ray's
serialization, the core worker, three event loops on each side), so a replica that streamed
each request's deltas on their own stream would spend half the machine on delivery at high
concurrency. Instead each caller (an ingress replica) holds one long-lived channel per replica,
and every delta of its requests goes on it: what the engine produced since the reader last
took is one item (a list of deltas, oldest first), whatever the number of requests.

The channel's reader is a plain TCP connection from the caller where it can reach the replica
(``ChannelServer``): on 2 cores a Serve stream item costs about 1 ms more CPU across the
processes than a length-prefixed pickle on a socket, 0.9 against 0.15-0.18 ms in the receiver
alone (``benchmarks/delta_transport.py``), and at one request that is paid on every token.
Where the caller cannot connect, the ``channel`` call's own Serve stream is the reader.

Once connected, the caller sends its requests for the replica on the same connection instead
of through Serve (a Serve handle call took 3.4 ms from ``remote()`` to the callee's first line
on 2 cores, a frame on an open connection a few tenths of one): those requests run as long as
their connection, and the ``channel`` call lasts as long as the connection too, so Serve's
graceful shutdown of the replica waits for them as it waits for its own calls.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import socket
import struct
import time
from typing import AsyncIterator, Callable

from pagefleet.worker.replica import hop_trace
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.replica.worker_request import SocketOffer

logger = logging.getLogger(__name__)

# A channel with no request for this long ends its stream.
IDLE_CLOSE_S = 5.0
# A socket channel's frames: this header (the body's length), then the pickled list of deltas.
FRAME_HEADER = struct.Struct("!I")
TOKEN_BYTES = 16
# A frame longer than this is not from a peer of ours: the connection is dropped.
MAX_FRAME_BYTES = 1 << 30
# An offer not claimed within this long is void; a connection that sends no token this long is closed.
OFFER_TTL_S = 30.0
HELLO_TIMEOUT_S = 5.0


def keep_alive(sock: socket.socket | None) -> None:
    """Probe an idle connection so one to a peer that vanished (no FIN) errors within ~30 s."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def encode_frame(batch: list[RequestOutputDelta]) -> bytes:
    body = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(body)) + body


class DeltaChannel:
    """Deltas waiting for the reader. One reader at a time: a new one takes over (the old one
    ends at its next wake-up), so a caller that lost its stream can open it again and get every
    delta not yet taken. Deltas queue while no reader is attached and requests still run."""

    def __init__(self) -> None:
        self.pending: list[RequestOutputDelta] = []
        self.requests = 0  # requests on this channel still running
        self._ready = asyncio.Event()
        self._reader: object | None = None

    @property
    def attached(self) -> bool:
        return self._reader is not None

    @property
    def unused(self) -> bool:
        """No reader and no request running: whatever is still pending has no one to go to."""
        return self._reader is None and self.requests == 0

    def put(self, delta: RequestOutputDelta) -> None:
        if hop_trace.PATH:
            hop_trace.mark(delta.request_id, "worker_channel_put")
        self.pending.append(delta)
        self._ready.set()

    async def batches(self, idle_close_s: float = IDLE_CLOSE_S) -> AsyncIterator[list[RequestOutputDelta]]:
        """The reader's stream: an empty list at once (attached), then one list per wake-up.
        It ends after ``idle_close_s`` with no request running and nothing pending: a replica
        that Serve stops then waits for no call of its own (the caller opens the channel again
        for its next request)."""
        token = object()
        self._reader = token
        self._ready.set()  # wakes a reader this one replaces, so it ends
        try:
            yield []
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
                    yield batch
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


# What a replica does with the commands a connection sends: (channel id, the frame's commands,
# that connection's running requests by id).
OnCommands = Callable[[str, list, "dict[str, asyncio.Task]"], None]


class ChannelServer:
    """A replica's listening socket for its callers' delta channels. ``offer(channel_id)`` makes
    a one-time token for that channel; a connection that sends it within ``HELLO_TIMEOUT_S`` becomes
    the channel's reader (``DeltaChannel.batches``, so it takes over from any other) and gets every
    batch as one frame, ``[]`` first. A peer without a token gets nothing and is closed; one with
    a token (handed out only by the replica's ``channel`` call, through Serve) may send frames the
    same way, each a list of requests and aborts, which go to ``on_commands`` with the tasks that
    connection's requests run in: when the connection ends, those still running are cancelled
    (their requests aborted). Listens on ``host`` (the node's address, where Ray's own workers
    listen), on a port the system picks when the first offer is made."""

    def __init__(self, host: str, channel_for: Callable[[str], DeltaChannel],
                 detached: Callable[[str], None], on_commands: OnCommands | None = None) -> None:
        self.host = host
        self._channel_for = channel_for
        self._detached = detached
        self._on_commands = on_commands
        self._offers: dict[bytes, Offered] = {}  # token -> offer not yet claimed
        self._server: asyncio.AbstractServer | None = None
        self._starting = asyncio.Lock()  # two first offers at once start one server
        self.port = 0

    async def offer(self, channel_id: str) -> tuple[SocketOffer, Offered]:
        if self._server is None:
            async with self._starting:
                if self._server is None:
                    self._server = await asyncio.start_server(self._serve, self.host, 0)
                    self.port = self._server.sockets[0].getsockname()[1]
        now = time.monotonic()
        self._offers = {t: o for t, o in self._offers.items() if o.valid_until > now}
        token = secrets.token_bytes(TOKEN_BYTES)
        offered = self._offers[token] = Offered(channel_id, now + OFFER_TTL_S)
        return SocketOffer(self.host, self.port, token), offered

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HELLO_TIMEOUT_S)
            offered = self._offers.pop(token, None)
            if offered is None or time.monotonic() > offered.valid_until:
                return
            offered.claimed.set()
            keep_alive(writer.get_extra_info("socket"))  # a caller that vanished ends its requests here too
            running: dict[str, asyncio.Task] = {}
            try:
                sending = asyncio.ensure_future(self._send_batches(offered.channel_id, writer))
                receiving = asyncio.ensure_future(self._receive_commands(offered.channel_id, reader, running))
                try:  # until the channel ends here (idle, or another reader took over) or the peer leaves
                    await asyncio.wait((sending, receiving), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in (sending, receiving, *running.values()):
                        task.cancel()
                    await asyncio.gather(sending, receiving, return_exceptions=True)
                    if running:  # their deltas not yet taken go to no one (a retry may come back here)
                        channel = self._channel_for(offered.channel_id)
                        channel.pending = [d for d in channel.pending if d.request_id not in running]
            finally:
                offered.ended.set()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.debug("delta channel connection ended: %s", type(e).__name__)
        finally:
            writer.close()

    async def _send_batches(self, channel_id: str, writer: asyncio.StreamWriter) -> None:
        batches = self._channel_for(channel_id).batches()
        try:
            async for batch in batches:
                writer.write(encode_frame(batch))
                await writer.drain()
        except ConnectionError as e:
            logger.debug("delta channel connection broke: %s", type(e).__name__)
        finally:
            await batches.aclose()  # detaches now, not when collected
            self._detached(channel_id)

    async def _receive_commands(self, channel_id: str, reader: asyncio.StreamReader,
                                running: dict[str, asyncio.Task]) -> None:
        """Until the peer closes its side (or sends what is not a frame of commands)."""
        try:
            while True:
                (length,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
                if length > MAX_FRAME_BYTES:
                    raise ValueError(f"a frame of {length} bytes")
                commands = pickle.loads(await reader.readexactly(length))
                if self._on_commands is None or not isinstance(commands, list):
                    raise ValueError("commands this replica does not take")
                self._on_commands(channel_id, commands, running)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        except Exception as e:  # noqa: BLE001 — a peer that speaks nonsense loses its connection
            logger.warning("delta channel %s: closing a connection that sent %r", channel_id, e)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
