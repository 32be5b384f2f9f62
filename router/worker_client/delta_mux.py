"""The ingress's side of its delta channels (``worker.replica.wire``): one channel per worker
replica carries the deltas of every request this ingress placed there, and this module hands
each delta to its request's queue. A channel is a TCP connection to the replica where the
ingress can reach it (the replica's ``channel`` call offers the address and a token), else that
call's own Serve stream; either carries the same encoded frames.

A request registers its queue before it is sent (its first deltas can arrive before its
``Placed``), says where it was placed, and reads its queue (``read_deltas``), where the
request's own stream also puts its ``Ended`` or its error (``watch``). A request whose
first-ranked replica's channel is an open connection is sent on that connection instead of
through Serve (``send``; ``wire`` says why); the replica answers it on the channel alone: deltas,
or a ``Notice`` that it is full (``ReplicaBusy``: the ingress sends it through Serve) or that it
failed. The reader of a replica's channel runs while requests are placed there: it opens the channel again if the stream breaks
(the replica keeps what was not taken) or ends (the replica closes a channel idle for a few
seconds), and stops once no request of this ingress runs there: the replica is gone and its
requests have failed on their own streams, or traffic stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import msgspec

from pagefleet.worker.errors import CompileQueueFull, EngineDeadError
from pagefleet.worker.outputs import RequestOutputDelta, merge_deltas
from pagefleet.worker.replica.delta_channel import keep_alive
from pagefleet.worker.replica.wire import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    Abort,
    ChannelOpen,
    Ended,
    Notice,
    SocketOffer,
    WorkerRequest,
    decode_batch,
    encode_commands,
)
from pagefleet.worker.request_check import InvalidRequest

logger = logging.getLogger(__name__)

# How long a channel may take to attach (routing to its replica and the replica's first item).
ATTACH_TIMEOUT_S = 10.0
# How long a request whose replica reported it ended waits for deltas still on the way.
LOST_OUTPUT_TIMEOUT_S = 30.0
REOPEN_BACKOFF_S = 0.2
# After a replica's socket could not be used, how long its Serve stream carries the channel before
# the socket is tried again (a replica that restarted, a network that healed).
SOCKET_RETRY_S = 60.0
# How long connecting to a replica's channel socket may take before its Serve stream is used.
CONNECT_TIMEOUT_S = 2.0


class LostOutputError(RuntimeError):
    """The replica sent more deltas than arrived (a channel broke with them in flight)."""


class ReplicaBusy(RuntimeError):
    """The replica refused a request sent on its channel connection: nothing of it ran."""


class ChannelLost(ConnectionError):
    """The channel connection a request was sent on ended before the request finished (the
    replica's process or node went away, or the connection broke): the replica aborted it."""


def notice_error(notice: Notice, replica_id: str) -> Exception:
    """The exception a ``Notice`` stands for, as a Serve call to the replica would have raised it."""
    if notice.kind == "refused":
        return ReplicaBusy(f"worker replica {replica_id} holds as many requests as it may")
    if notice.kind == "invalid":
        return InvalidRequest(notice.message, notice.param, notice.code)
    if notice.kind == "engine_dead":
        return EngineDeadError(notice.message)
    if notice.kind == "busy":
        return CompileQueueFull(notice.message)
    return RuntimeError(f"worker replica {replica_id}: {notice.message}")


@dataclass(slots=True)
class MuxCounters:
    channels_opened: int = 0
    socket_channels: int = 0  # of those, on a TCP connection
    batches: int = 0
    deltas: int = 0  # the batches' items: deltas, and notices of requests sent on the connection
    unclaimed: int = 0  # items of no running request (cancelled meanwhile, or a send that failed)
    sent: int = 0  # requests sent on a channel connection
    refused: int = 0  # of those, refused by the replica (then sent through Serve)


class SocketUnusable(ConnectionError):
    """The replica's channel socket cannot be reached (``reason`` "connect"), or drops the
    connection unanswered ("dropped")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _FrameReader(asyncio.Protocol):
    """The ingress's end of a socket channel: sends the offer's token, then hands each frame's
    body to ``on_body`` as it arrives. ``done`` resolves when the connection ends: to whether
    any frame came (the replica accepted the token), or to the error it broke with."""

    def __init__(self, token: bytes, on_body: Callable[[memoryview], None]) -> None:
        self._token = token
        self._on_body = on_body
        self._buf = bytearray()
        self.frames = 0
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def open(self) -> bool:
        """Attached (the replica's first frame came) and not ended."""
        return self.frames > 0 and not self.done.done() and not self._transport.is_closing()

    def send(self, commands: list[WorkerRequest | Abort]) -> None:
        self._transport.write(encode_commands(commands))  # type: ignore[attr-defined]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        transport.write(self._token)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start, size = 0, len(buf)
        while size - start >= FRAME_HEADER.size:
            (length,) = FRAME_HEADER.unpack_from(buf, start)
            if length > MAX_FRAME_BYTES:
                self._transport.abort()
                return
            end = start + FRAME_HEADER.size + length
            if end > size:
                break
            body = memoryview(buf)[start + FRAME_HEADER.size:end]
            start = end
            self.frames += 1
            try:
                self._on_body(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # not a peer of ours
                self._transport.abort()
                if not self.done.done():
                    self.done.set_exception(ConnectionError(f"a frame that is not a delta batch: {exc}"))
                return
            finally:
                body.release()  # the buffer is resized below
        del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is not None:
                self.done.set_exception(exc)
            else:
                self.done.set_result(self.frames > 0)


class ChannelMux:
    """``open_channel(ChannelOpen)`` starts a replica's ``channel`` call (a Serve handle call the
    request routers pin to that replica). With ``sockets``, the call asks for a ``SocketOffer``
    and the channel is the TCP connection that claims it; a replica whose socket cannot be
    reached gets Serve-stream channels for the next ``SOCKET_RETRY_S``."""

    def __init__(self, open_channel: Callable[[ChannelOpen], Any], channel_id: str | None = None,
                 attach_timeout_s: float = ATTACH_TIMEOUT_S, sockets: bool = True,
                 on_opened: Callable[[str], None] = lambda transport: None,
                 on_socket_unusable: Callable[[str], None] = lambda reason: None, node_id: str | None = None) -> None:
        """``on_opened(transport)`` is called for each channel attached ("socket" or "serve_stream"),
        ``on_socket_unusable(reason)`` for each socket that could not be used (``SocketUnusable``).
        ``node_id``: this caller's Ray node (a replica there offers its loopback socket)."""
        self.channel_id = channel_id or uuid.uuid4().hex
        self._open = open_channel
        self._on_opened = on_opened
        self._on_socket_unusable = on_socket_unusable
        self.node_id = node_id
        self.attach_timeout_s = attach_timeout_s
        self._sockets = sockets
        self._no_socket: dict[str, float] = {}  # replica -> until when its socket is not tried again
        self._queues: dict[str, asyncio.Queue] = {}
        self._replica_of: dict[str, str] = {}  # request id -> replica it was placed on
        self._on: dict[str, set[str]] = {}  # replica -> request ids placed there
        self._readers: dict[str, asyncio.Task] = {}
        self._connections: dict[str, _FrameReader] = {}  # replica -> its channel's open connection
        self._sent: set[str] = set()  # requests sent on their replica's connection, still running there
        self.counters = MuxCounters()

    def register(self, request_id: str) -> asyncio.Queue:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def placed(self, request_id: str, replica_id: str) -> None:
        """The request runs on ``replica_id``: its channel is read from now on."""
        self._unplace(request_id)
        self._replica_of[request_id] = replica_id
        self._on.setdefault(replica_id, set()).add(request_id)
        if replica_id not in self._readers:
            self._readers[replica_id] = asyncio.ensure_future(self._read(replica_id))

    def send(self, request: WorkerRequest, replica_id: str) -> bool:
        """Sends ``request`` on the replica's channel connection and says so, or says it has none
        open (the request goes through Serve). Its deltas, refusal or error come to its queue."""
        connection = self._connections.get(replica_id)
        if connection is None or not connection.open:
            return False
        self.placed(request.request_id, replica_id)
        self._sent.add(request.request_id)
        connection.send([request])
        self.counters.sent += 1
        return True

    def abort(self, request_id: str) -> None:
        """Stops a request sent on a connection that has not finished (its client went away)."""
        if request_id not in self._sent:
            return
        self._sent.remove(request_id)
        connection = self._connections.get(self._replica_of.get(request_id, ""))
        if connection is not None and connection.open:
            connection.send([Abort(request_id)])

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._sent.discard(request_id)
        self._unplace(request_id)

    def _unplace(self, request_id: str) -> None:
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is not None:
            self._on[replica_id].discard(request_id)

    async def _read(self, replica_id: str) -> None:
        try:
            while self._on.get(replica_id):
                use_socket = self._sockets and self._no_socket.get(replica_id, 0.0) <= time.monotonic()
                stream = self._open(ChannelOpen(self.channel_id, replica_id, socket=use_socket, node_id=self.node_id))
                try:
                    # an empty batch once attached, or where to connect
                    first = await asyncio.wait_for(stream.__anext__(), self.attach_timeout_s)
                    if isinstance(first, SocketOffer):
                        await self._read_socket(replica_id, first)
                        continue
                    self.counters.channels_opened += 1
                    self._on_opened("serve_stream")
                    self._dispatch(replica_id, first)
                    async for body in stream:
                        self._dispatch(replica_id, body)
                except SocketUnusable as exc:
                    self._no_socket[replica_id] = time.monotonic() + SOCKET_RETRY_S
                    self._on_socket_unusable(exc.reason)
                    logger.warning("delta channel socket of %s unusable (%s); its Serve stream carries the "
                                   "channel for the next %.0f s", replica_id, exc, SOCKET_RETRY_S)
                except Exception as exc:  # noqa: BLE001 — the replica's requests fail on their own streams
                    if self._on.get(replica_id):
                        logger.warning("delta channel to %s broke (%s); opening it again", replica_id,
                                       type(exc).__name__)
                        await asyncio.sleep(REOPEN_BACKOFF_S)
                finally:
                    stream.cancel()
        finally:
            self._readers.pop(replica_id, None)
            if not self._on.get(replica_id):
                self._on.pop(replica_id, None)

    async def _read_socket(self, replica_id: str, offer: SocketOffer) -> None:
        """Reads the channel on a connection to ``offer`` until it ends: returns when the replica
        closed it (the channel idle, or another reader took over), raises if it broke, and
        ``SocketUnusable`` if it cannot be made or the replica drops it before its first frame."""
        loop = asyncio.get_running_loop()
        try:
            transport, reader = await asyncio.wait_for(loop.create_connection(
                lambda: _FrameReader(offer.token, lambda body: self._dispatch(replica_id, body)),
                offer.host, offer.port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            raise SocketUnusable("connect", f"connecting to {offer.host}:{offer.port}: {exc!r}") from exc
        self._connections[replica_id] = reader
        try:
            keep_alive(transport.get_extra_info("socket"))
            self.counters.channels_opened += 1
            self.counters.socket_channels += 1
            self._on_opened("socket")
            try:
                answered = await reader.done
            except ConnectionError as exc:  # reset: closed with our token unread
                if reader.frames:
                    raise
                raise SocketUnusable("dropped", f"{offer.host}:{offer.port} reset the connection unanswered") from exc
            if not answered:
                raise SocketUnusable("dropped", f"{offer.host}:{offer.port} closed the connection unanswered")
        finally:
            transport.close()
            if self._connections.get(replica_id) is reader:
                del self._connections[replica_id]
            self._lose_sent(replica_id)

    def _lose_sent(self, replica_id: str) -> None:
        """The requests sent on a replica's connection that ended: the replica aborts them."""
        for request_id in [r for r in self._sent if self._replica_of.get(r) == replica_id]:
            self._sent.discard(request_id)
            q = self._queues.get(request_id)
            if q is not None:
                q.put_nowait(ChannelLost(f"the channel connection to worker replica {replica_id} ended"))

    def _dispatch(self, replica_id: str, body: bytes | memoryview) -> None:
        """Hands each delta (or notice) of one channel item to its request's queue
        (``msgspec.ValidationError`` or ``DecodeError`` for an item that is not a delta batch)."""
        batch = decode_batch(body)
        self.counters.batches += 1
        self.counters.deltas += len(batch)
        for item in batch:
            request_id = item.request_id
            q = self._queues.get(request_id)
            # From the replica it runs on; before its Placed arrives, from wherever it runs. A send
            # that failed has an id of its own, whose queue is gone: its late deltas go to no one.
            if q is None or self._replica_of.get(request_id, replica_id) != replica_id:
                self.counters.unclaimed += 1
            elif isinstance(item, RequestOutputDelta):
                if item.finished:
                    self._sent.discard(request_id)
                q.put_nowait(item)
            else:  # a request sent on the connection that did not run, or failed
                self._sent.discard(request_id)
                if item.kind == "refused":  # it goes through Serve, to this replica or another
                    self._unplace(request_id)
                    self.counters.refused += 1
                q.put_nowait(notice_error(item, replica_id))


async def watch(response: Any, q: asyncio.Queue) -> None:
    """Put what a channel request's own stream carries after its ``Placed`` (its ``Ended``, or
    the error it failed with) on the request's queue."""
    try:
        async for item in response:
            q.put_nowait(item)
    except Exception as exc:  # noqa: BLE001 — the reader raises it in the request's task
        q.put_nowait(exc)


async def read_deltas(q: asyncio.Queue,
                      lost_output_timeout_s: float = LOST_OUTPUT_TIMEOUT_S) -> AsyncIterator[RequestOutputDelta]:
    """A request's deltas from its queue until the finished one, merged where the consumer fell
    behind (one delta per read); raises the request's error, or ``LostOutputError`` when its
    replica ended it and deltas it sent never came."""
    seen = 0
    expected: int | None = None
    while True:
        if expected is None:
            items = [await q.get()]
        else:
            try:
                items = [await asyncio.wait_for(q.get(), lost_output_timeout_s)]
            except asyncio.TimeoutError:
                raise LostOutputError(f"the worker sent {expected} deltas, {seen} arrived") from None
        while not q.empty():
            items.append(q.get_nowait())
        deltas = [i for i in items if isinstance(i, RequestOutputDelta)]
        if deltas:
            seen += len(deltas)
            delta = merge_deltas(deltas)
            yield delta
            if delta.finished:
                return
        for item in items:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Ended):
                expected = item.num_deltas
        if expected is not None and seen >= expected:
            raise LostOutputError(f"the worker ended the request after {expected} deltas, none finished")
