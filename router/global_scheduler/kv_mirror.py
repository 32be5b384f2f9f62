"""An ingress replica's own copy of the global scheduler's view, kept current from the actor's feed.

``SchedulerMirror`` is a ``GlobalScheduler`` core fed the actor's inputs in the
actor's order (``view_feed``), so it holds exactly the actor's view of every
worker's blocks and load, one feed round trip later. The ingress routes with
it locally (``KVRoutingClient``): no call on a request's path. Predictions
(blocks and prefix entries of requests this ingress just routed) live only
here, as the ingress's own bookkeeping; the workers' batches confirm them as
they do in the actor. The mirror drops no worker on its own clock: the actor
decides liveness and the feed says so.

``ViewFollower`` is the loop that keeps it current: one long poll at a time
(answered as soon as the feed has news, or after ``poll_wait_s`` with none),
at most one every ``min_interval_s`` (100 ms: so a busy fleet's batches arrive as a
few larger updates instead of a call per batch, and the actor answers fewer calls; the
workers publish at most every ``kv_publisher.PUBLISH_INTERVAL_S`` anyway); a failed call (the actor is
dead or restarting) is retried after ``backoff_s``. ``FeedLink`` carries the
calls (a Ray actor handle in the ingress; a fake in tests).

The copy's age (what routing compares with ``max_staleness_s``) counts from the last reply,
or from the end of the wait of the poll sent right after it, whichever is later: that poll
is answered at once when anything changes, so until its wait is over, no answer means
nothing changed. An idle fleet's feed can then wait long (``POLL_WAIT_S``) without its copy
going stale between replies. A call that fails takes the wait's word back (when the actor died
during it is not known): the copy's age counts from the last reply again. Each poll costs
the actor, the ingress and Ray's processes CPU, on a machine whose cores a CPU engine may need,
so an idle feed should poll rarely.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from itertools import groupby
from typing import Callable, Protocol

from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.view_feed import ViewUpdate, WorkerDropped
from pagefleet.worker.aio import cancel_and_wait
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot

logger = logging.getLogger(__name__)

# How long a poll waits for news. An idle fleet's copy costs one poll per wait (and stays current
# meanwhile: see the module's docstring); with news, the poll returns at once. Long, so that an
# idle app wakes its ingress, the actor and Ray's processes rarely (docs/scaling.md).
POLL_WAIT_S = 2.0


@dataclass(slots=True)
class MirrorCounters:
    updates: int = 0  # replies applied (empty ones included)
    entries: int = 0  # feed entries applied
    resyncs: int = 0  # whole views applied (first sync, an actor restart, a follower too far behind)
    failed_polls: int = 0


class SchedulerMirror:
    def __init__(self, weight: float, prediction_ttl_s: float = 2.0, max_seqs_per_worker: int | None = None) -> None:
        # liveness is the actor's call (its drops come through the feed), never this copy's clock
        self.core = GlobalScheduler(weight=weight, prediction_ttl_s=prediction_ttl_s, liveness_timeout_s=math.inf,
                                    max_seqs_per_worker=max_seqs_per_worker)
        self.epoch: str | None = None
        self.cursor = -1
        self.updated_at = -math.inf  # when the last reply was applied (monotonic)
        # the end of the wait of a poll sent right after a reply (it vouches for the copy until then)
        self.vouched_until = -math.inf
        self.counters = MirrorCounters()

    def age(self, now: float) -> float:
        """Seconds since this copy was last known current: since the last reply, or since the end
        of the wait of the poll that followed it, whichever is later (0 while that wait lasts)."""
        return now - max(self.updated_at, min(now, self.vouched_until))

    def apply(self, update: ViewUpdate, now: float) -> None:
        core = self.core
        if update.states is not None:
            core.restore(update.states, now)
            self.counters.resyncs += 1
        # Consecutive batches go in together: one call into the index for a run of them.
        for kind, run in groupby(update.entries, type):
            if kind is KVEventBatch:
                core.apply_batches(list(run), now)  # a gap's snapshot request is the actor's to make
            elif kind is KVSnapshot:
                for snapshot in run:
                    core.apply_snapshot(snapshot, now)
            elif kind is WorkerDropped:
                for dropped in run:
                    core.drop_worker(dropped.worker_id)
            else:
                raise TypeError(f"unknown feed entry {kind.__name__}")
        self.epoch, self.cursor, self.updated_at = update.epoch, update.cursor, now
        self.counters.updates += 1
        self.counters.entries += len(update.entries)


class FeedLink(Protocol):
    async def updates(self, epoch: str | None, cursor: int, wait_s: float) -> ViewUpdate:
        ...


class ViewFollower:
    def __init__(self, link: FeedLink, mirror: SchedulerMirror, *, poll_wait_s: float = POLL_WAIT_S,
                 min_interval_s: float = 0.1, backoff_s: float = 0.5, call_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, on_update: Callable[[], None] | None = None) -> None:
        """``on_update`` is called after each applied update (e.g. to wake requests waiting for room)."""
        self.link = link
        self.mirror = mirror
        self.poll_wait_s = poll_wait_s
        self.min_interval_s = min_interval_s
        self.backoff_s = backoff_s
        self.call_timeout_s = call_timeout_s
        self.clock = clock
        self.on_update = on_update or (lambda: None)
        self._after_reply = False  # the last poll was answered and applied: the next one vouches for the copy
        self._task: asyncio.Task | None = None

    async def poll_once(self, wait_s: float | None = None) -> bool:
        """One poll applied to the mirror; False when the call failed."""
        mirror = self.mirror
        wait = self.poll_wait_s if wait_s is None else wait_s
        if self._after_reply:
            mirror.vouched_until = self.clock() + wait
        self._after_reply = applied = False
        try:
            try:
                update = await asyncio.wait_for(self.link.updates(mirror.epoch, mirror.cursor, wait),
                                                wait + self.call_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor is dead, restarting or swamped: the mirror ages
                mirror.counters.failed_polls += 1
                logger.debug("polling the global scheduler's feed failed: %r", exc)
                return False
            mirror.apply(update, self.clock())
            applied = True
        finally:
            if not applied:  # failed, cancelled or not applied: the wait's word is taken back
                mirror.vouched_until = -math.inf
        self._after_reply = True
        self.on_update()
        return True

    def start(self) -> None:
        """Follow the feed from the running event loop until ``close``."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pagefleet-view-follower")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            started = self.clock()
            try:
                ok = await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # an update this copy could not apply: start again from a whole view
                logger.exception("applying the global scheduler's feed failed; resynchronising")
                self.mirror.epoch, ok = None, False
            pause = self.min_interval_s - (self.clock() - started) if ok else self.backoff_s
            if pause > 0:
                await asyncio.sleep(pause)
