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
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import struct
import time
from typing import AsyncIterator, Callable

from pagefleet.worker import hop_trace
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.worker_request import SocketOffer

logger = logging.getLogger(__name__)

# A channel with no request for this long ends its stream.
IDLE_CLOSE_S = 5.0
# A socket channel's frames: this header (the body's length), then the pickled list of deltas.
FRAME_HEADER = struct.Struct("!I")
TOKEN_BYTES = 16
# An offer not claimed within this long is void; a connection that sends no token this long is closed.
OFFER_TTL_S = 30.0
HELLO_TIMEOUT_S = 5.0


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


class ChannelServer:
    """A replica's listening socket for its callers' delta channels. ``offer(channel_id)`` makes
    a one-time token for that channel; a connection that sends it within ``HELLO_TIMEOUT_S`` becomes
    the channel's reader (``DeltaChannel.batches``, so it takes over from any other) and gets every
    batch as one frame, ``[]`` first. Nothing is read from a connection but its token: a peer
    without one gets nothing and is closed. Listens on ``host`` (the node's address, where Ray's
    own workers listen), on a port the system picks when the first offer is made."""

    def __init__(self, host: str, channel_for: Callable[[str], DeltaChannel],
                 detached: Callable[[str], None]) -> None:
        self.host = host
        self._channel_for = channel_for
        self._detached = detached
        self._offers: dict[bytes, tuple[str, float]] = {}  # token -> (channel id, valid until)
        self._server: asyncio.AbstractServer | None = None
        self._starting = asyncio.Lock()  # two first offers at once start one server
        self.port = 0

    async def offer(self, channel_id: str) -> SocketOffer:
        if self._server is None:
            async with self._starting:
                if self._server is None:
                    self._server = await asyncio.start_server(self._serve, self.host, 0)
                    self.port = self._server.sockets[0].getsockname()[1]
        now = time.monotonic()
        self._offers = {t: o for t, o in self._offers.items() if o[1] > now}
        token = secrets.token_bytes(TOKEN_BYTES)
        self._offers[token] = (channel_id, now + OFFER_TTL_S)
        return SocketOffer(self.host, self.port, token)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HELLO_TIMEOUT_S)
            channel_id, valid_until = self._offers.pop(token, ("", 0.0))
            if time.monotonic() > valid_until:
                return
            batches = self._channel_for(channel_id).batches()
            try:
                async for batch in batches:
                    writer.write(encode_frame(batch))
                    await writer.drain()
            finally:
                await batches.aclose()  # detaches now, not when collected
                self._detached(channel_id)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.debug("delta channel connection ended: %s", type(e).__name__)
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
