"""A worker replica's side of one caller's delta channel.

Serve streams cost about as much CPU per item as the engine spends on a token (Ray's
serialization, the core worker, three event loops on each side), so a replica that streamed
each request's deltas on their own stream would spend half the machine on delivery at high
concurrency. Instead each caller (an ingress replica) holds one long-lived stream per replica,
and every delta of its requests goes on it: what the engine produced since the reader last
took is one item (a list of deltas, oldest first), whatever the number of requests.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from pagefleet.worker import hop_trace
from pagefleet.worker.outputs import RequestOutputDelta

# A channel with no request for this long ends its stream.
IDLE_CLOSE_S = 5.0


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
