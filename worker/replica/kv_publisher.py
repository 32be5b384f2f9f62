"""Sends one worker's KV event batches to the global scheduler without ever blocking the engine.

The engine thread hands a batch to ``put`` (a bounded deque append
and a wake-up of the event loop: nothing that can wait) after a step at which
``ready`` says it would go out at once. A task on the
replica's event loop sends them in order, one call in flight at a time and at
most one every ``min_interval_s``; batches that pile up meanwhile go out merged
into one (``merge_batches``), so a slow scheduler gets fewer, larger calls, and
a fast engine (a GPU's steps every few milliseconds) costs neither the
scheduler, its followers and Ray a call per step nor itself a batch per step
(its event log holds the steps' changes until ``ready``). A batch that changes
nothing the scheduler reads (no events, the same counters as the batch before:
most decode steps, between one block filling and the next) does not wake the
sender; it goes out merged into the next batch that does, or after
``heartbeat_s``. When even the deque overflows, the oldest
batches are dropped: their numbers go missing, the scheduler sees the gap and
asks for a snapshot, which this publisher takes (on the engine thread) and
sends in sequence with the batches. A failed call is not retried: it leaves a
gap too. No Ray here: ``SchedulerLink`` is whatever carries the calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from pagefleet.worker.aio import cancel_and_wait
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot, merge_batches

# At most one call every this long. Each call costs the scheduler actor CPU and wakes each
# ingress's follower, CPU taken from the engines and the ingress (figures in docs/scaling.md).
# The view stays exact (batches merge, nothing is dropped); an ingress's own routing does not
# wait for it (its predictions count what it routed until a batch confirms it), only other
# ingresses see this worker's load later.
PUBLISH_INTERVAL_S = 0.2
# How long a batch that changes nothing the scheduler reads may wait for one that does (an idle
# engine puts one every second). It is the worker's heartbeat: the scheduler drops a worker silent
# for ``GlobalScheduler.liveness_timeout_s`` (10 s), three of these and more. Every call wakes the
# actor, each ingress's follower and Ray's processes (this and the follower's wait: see
# ``kv_mirror.POLL_WAIT_S``).
HEARTBEAT_S = 3.0

logger = logging.getLogger(__name__)


class SchedulerLink(Protocol):
    async def publish(self, batch: KVEventBatch) -> bool:
        """Deliver a batch; True when the scheduler wants a snapshot."""

    async def publish_snapshot(self, snapshot: KVSnapshot) -> None:
        ...


@dataclass(slots=True)
class PublisherCounters:
    batches: int = 0  # put by the engine
    calls: int = 0  # sent (a merged batch is one call)
    quiet: int = 0  # changed nothing the scheduler reads, so woke no sender
    dropped: int = 0  # lost to a full buffer
    failed_calls: int = 0
    snapshots: int = 0


class KVEventPublisher:
    def __init__(self, link: SchedulerLink, take_snapshot: Callable[[], Awaitable[KVSnapshot]], *,
                 max_pending: int = 256, call_timeout_s: float = 5.0, backoff_s: float = 1.0,
                 min_interval_s: float = PUBLISH_INTERVAL_S, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.link = link
        self.take_snapshot = take_snapshot
        self.call_timeout_s = call_timeout_s
        self.backoff_s = backoff_s
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s
        self.counters = PublisherCounters()
        self._last_state: tuple | None = None  # what the scheduler reads of the batch put last
        self._last_wake = float("-inf")
        self._next_call = float("-inf")  # no call before this (time.monotonic)
        self._pending: deque[KVEventBatch] = deque(maxlen=max_pending)
        self._covered = -1  # batches up to this number are inside a snapshot already sent
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start sending, from the event loop that will run the sends."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            if self._pending:
                self._wake.set()  # put before the start
            self._task = self._loop.create_task(self._run(), name="pagefleet-kv-publisher")

    def ready(self) -> bool:
        """Whether a batch put now would be sent at once: none waits, and the last call was at
        least ``min_interval_s`` ago. Any thread."""
        return not self._pending and time.monotonic() >= self._next_call

    def put(self, batch: KVEventBatch) -> None:
        """One thread (the engine's); never waits."""
        if len(self._pending) == self._pending.maxlen:
            self.counters.dropped += 1
        self._pending.append(batch)  # a full deque drops its oldest
        self.counters.batches += 1
        previous, self._last_state = self._last_state, _state(batch)
        now = time.monotonic()
        if (previous is not None and previous == self._last_state and now - self._last_wake < self.heartbeat_s
                and len(self._pending) < self._pending.maxlen // 2):
            self.counters.quiet += 1
            return
        self._last_wake = now
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop is closed: the replica is going away
                pass

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        assert self._wake is not None and self._loop is not None
        last_call = float("-inf")
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                wait = last_call + self.min_interval_s - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)  # what is put meanwhile goes out with it, merged
                last_call = self._loop.time()
                self._next_call = time.monotonic() + self.min_interval_s
                await self._send_pending()

    async def _send_pending(self) -> None:
        batches = []
        while self._pending:
            batches.append(self._pending.popleft())
        for run in _consecutive_runs([b for b in batches if b.seq > self._covered]):
            run = [b for b in run if b.seq > self._covered]  # a snapshot taken meanwhile covers them
            if not run:
                continue
            try:
                wants_snapshot = await asyncio.wait_for(self.link.publish(merge_batches(run)), self.call_timeout_s)
                self.counters.calls += 1
                if wants_snapshot:
                    await self._send_snapshot()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the scheduler is down or restarting: its next view starts from a gap
                self.counters.failed_calls += 1
                logger.debug("publishing KV events failed: %r", exc)
                await asyncio.sleep(self.backoff_s)
                return

    async def _send_snapshot(self) -> None:
        snapshot = await self.take_snapshot()
        self._covered = snapshot.seq
        await asyncio.wait_for(self.link.publish_snapshot(snapshot), self.call_timeout_s)
        self.counters.snapshots += 1


def _consecutive_runs(batches: list[KVEventBatch]) -> list[list[KVEventBatch]]:
    runs: list[list[KVEventBatch]] = []
    for batch in batches:
        if runs and batch.first_seq == runs[-1][-1].seq + 1:
            runs[-1].append(batch)
        else:
            runs.append([batch])
    return runs


def _state(batch: KVEventBatch) -> tuple | None:
    """What the scheduler reads of a batch that has no events (None: it has some)."""
    if batch.cleared or batch.stored or batch.removed or batch.added or batch.acquired or batch.released:
        return None
    return (batch.num_free_blocks, batch.num_total_blocks, batch.num_running, batch.num_waiting,
            batch.num_reserved_blocks)
