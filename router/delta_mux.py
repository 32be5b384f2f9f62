"""The ingress's side of its delta channels (``worker.delta_channel``): one Serve stream per
worker replica carries the deltas of every request this ingress placed there, and this module
hands each delta to its request's queue.

A request registers its queue before it is sent (its first deltas can arrive before its
``Placed``), says where it was placed, and reads its queue (``read_deltas``), where the
request's own stream also puts its ``Ended`` or its error (``watch``). The reader of a replica's
channel runs while requests are placed there: it opens the channel again if the stream breaks
(the replica keeps what was not taken) or ends (the replica closes a channel idle for a few
seconds), and stops once no request of this ingress runs there: the replica is gone and its
requests have failed on their own streams, or traffic stopped.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from pagefleet.worker import hop_trace
from pagefleet.worker.outputs import RequestOutputDelta, merge_deltas
from pagefleet.worker.worker_request import ChannelOpen, Ended

logger = logging.getLogger(__name__)

# How long a channel may take to attach (routing to its replica and the replica's first item).
ATTACH_TIMEOUT_S = 10.0
# How long a request whose replica reported it ended waits for deltas still on the way.
LOST_OUTPUT_TIMEOUT_S = 30.0
REOPEN_BACKOFF_S = 0.2


class LostOutputError(RuntimeError):
    """The replica sent more deltas than arrived (a channel broke with them in flight)."""


@dataclass(slots=True)
class MuxCounters:
    channels_opened: int = 0
    batches: int = 0
    deltas: int = 0
    unclaimed: int = 0  # deltas of no running request (cancelled meanwhile) or from a replica it left


class ChannelMux:
    """``open_channel(ChannelOpen)`` starts a replica's channel stream (a Serve handle call the
    request routers pin to that replica)."""

    def __init__(self, open_channel: Callable[[ChannelOpen], Any], channel_id: str | None = None,
                 attach_timeout_s: float = ATTACH_TIMEOUT_S) -> None:
        self.channel_id = channel_id or uuid.uuid4().hex
        self._open = open_channel
        self.attach_timeout_s = attach_timeout_s
        self._queues: dict[str, asyncio.Queue] = {}
        self._replica_of: dict[str, str] = {}  # request id -> replica it was placed on
        self._left: dict[str, set[str]] = {}  # request id -> replicas an earlier attempt ran on
        self._on: dict[str, set[str]] = {}  # replica -> request ids placed there
        self._readers: dict[str, asyncio.Task] = {}
        self.counters = MuxCounters()

    def register(self, request_id: str) -> asyncio.Queue:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        return self._new_queue(request_id)

    def _new_queue(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def retry(self, request_id: str) -> asyncio.Queue:
        """A fresh queue for the request's next attempt (nothing the failed attempt's stream still
        puts reaches it), deaf to the replica the failed attempt ran on."""
        replica_id = self._replica_of.get(request_id)
        if replica_id is not None:
            self._left.setdefault(request_id, set()).add(replica_id)
        self._unplace(request_id)
        return self._new_queue(request_id)

    def placed(self, request_id: str, replica_id: str) -> None:
        """The request runs on ``replica_id``: its channel is read from now on."""
        self._unplace(request_id)
        self._left.get(request_id, set()).discard(replica_id)  # a replica that came back
        self._replica_of[request_id] = replica_id
        self._on.setdefault(replica_id, set()).add(request_id)
        if replica_id not in self._readers:
            self._readers[replica_id] = asyncio.ensure_future(self._read(replica_id))

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._left.pop(request_id, None)
        self._unplace(request_id)

    def _unplace(self, request_id: str) -> None:
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is not None:
            self._on[replica_id].discard(request_id)

    async def _read(self, replica_id: str) -> None:
        try:
            while self._on.get(replica_id):
                stream = self._open(ChannelOpen(self.channel_id, replica_id))
                try:
                    await asyncio.wait_for(stream.__anext__(), self.attach_timeout_s)  # [] once attached
                    self.counters.channels_opened += 1
                    async for batch in stream:
                        self._dispatch(replica_id, batch)
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

    def _dispatch(self, replica_id: str, batch: list[RequestOutputDelta]) -> None:
        self.counters.batches += 1
        self.counters.deltas += len(batch)
        for delta in batch:
            if hop_trace.PATH:
                hop_trace.mark(delta.request_id, "ingress_channel_recv")
            q = self._queues.get(delta.request_id)
            # Not from a replica a failed attempt ran on (its deltas still on the way); before
            # the request's Placed arrives, from wherever it runs.
            if q is None or self._replica_of.get(delta.request_id, replica_id) != replica_id \
                    or replica_id in self._left.get(delta.request_id, ()):
                self.counters.unclaimed += 1
            else:
                q.put_nowait(delta)


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
