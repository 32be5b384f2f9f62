"""The global scheduler as a named Ray actor: a thin shell around ``GlobalScheduler`` and its feed.

One per cluster (name ``SCHEDULER_NAME`` in namespace ``SCHEDULER_NAMESPACE``),
started by the app builder, detached so it outlives the process that built the
app (``serve run --non-blocking``, ``serve deploy``), restarted by Ray if it
dies. Workers publish KV event batches to it; it is the source of truth for
their view. Ingress replicas do not ask it where a request goes: each follows
its feed (``updates``, a long poll that answers as soon as there is something
new, or after ``wait_s`` with nothing) into a copy of the view and routes
with that (``kv_mirror``). A restarted actor starts empty under a new epoch:
the first batch from each worker shows a gap and the worker answers with a
snapshot, so the view (and every copy, which gets the new epoch's whole view)
rebuilds itself within a publish period.

An async actor whose methods never await inside a change to the core, so
calls still apply one at a time on its one event loop (the core is not
thread-safe and needs no lock that way); only ``updates`` waits, between
changes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import ray

from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.view_feed import ViewFeed, ViewUpdate, WorkerDropped
from pagefleet.router.global_scheduler.views import SchedulerCounters
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot

SCHEDULER_NAME = "pagefleet-global-scheduler"
SCHEDULER_NAMESPACE = "pagefleet"


@dataclass(slots=True)
class WorkerKVView:
    """What the scheduler holds for one worker (tests compare it with the worker's own pool)."""

    worker_id: str
    seq: int
    synced: bool
    routing_keys: set[int]
    num_free_blocks: int
    num_total_blocks: int
    in_use_keys: set[int] = field(default_factory=set)  # those a running sequence holds


class GlobalSchedulerActor:
    """The cluster's view of every worker's KV blocks and load, and the feed its copies follow.
    It routes nothing: each ingress ranks the workers on its own copy (``kv_mirror``), with its
    app's cost weight, so the core's ranking options are unused here and its decision and
    prediction counters stay 0; its view counters (batches, gaps, snapshots, drops) count."""

    def __init__(self) -> None:
        self.core = GlobalScheduler()
        self.started_at = time.time()
        self.feed = ViewFeed(epoch=uuid.uuid4().hex)
        self._news = asyncio.Event()  # set (and replaced) whenever the feed grows

    async def publish(self, batch: KVEventBatch) -> bool:
        now = time.monotonic()
        self._expire(now)
        wants_snapshot = self.core.apply_batch(batch, now)
        self._append(batch)
        return wants_snapshot

    async def publish_snapshot(self, snapshot: KVSnapshot) -> None:
        self.core.apply_snapshot(snapshot, time.monotonic())
        self._append(snapshot)

    async def drop_worker(self, worker_id: str) -> bool:
        dropped = self.core.drop_worker(worker_id)
        if dropped:
            self._append(WorkerDropped(worker_id))
        return dropped

    async def updates(self, epoch: str | None, cursor: int, wait_s: float) -> ViewUpdate:
        """What a copy of the view at (``epoch``, ``cursor``) lacks, as soon as there is something,
        or after ``wait_s`` (an empty update: the copy is current as of now)."""
        self._expire(time.monotonic())
        if not self.feed.has_news(epoch, cursor):
            try:
                await asyncio.wait_for(self._news.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return self.feed.update_since(epoch, cursor, self.core)

    async def worker_view(self, worker_id: str) -> WorkerKVView | None:
        return worker_kv_view(self.core, worker_id)

    async def worker_ids(self) -> set[str]:
        """The workers in the view (a silent one leaves it here first: ``_expire``)."""
        self._expire(time.monotonic())
        return set(self.core.workers)

    async def counters(self) -> SchedulerCounters:
        """The view's counters (the decision and prediction ones count in each ingress's copy)."""
        return self.core.counters

    async def start_time(self) -> float:
        """When this incarnation started (a restart shows as a later time)."""
        return self.started_at

    def _expire(self, now: float) -> None:
        for worker_id in self.core.expire(now):
            self._append(WorkerDropped(worker_id))

    def _append(self, entry) -> None:
        self.feed.append(entry)
        self._news.set()
        self._news = asyncio.Event()


def worker_kv_view(core: GlobalScheduler, worker_id: str) -> WorkerKVView | None:
    """What ``core`` holds for one worker (the actor's view, or an ingress's copy of it)."""
    view = core.workers.get(worker_id)
    if view is None:
        return None
    return WorkerKVView(worker_id, view.seq, view.synced, core.keys_of(worker_id) or set(), view.num_free_blocks,
                        view.num_total_blocks, core.in_use_of(worker_id))


def start_scheduler():
    """The cluster's scheduler actor, started if it is not running."""
    actor = ray.remote(GlobalSchedulerActor).options(
        name=SCHEDULER_NAME, namespace=SCHEDULER_NAMESPACE, get_if_exists=True, lifetime="detached",
        max_restarts=-1, num_cpus=0).remote()
    ray.get(actor.start_time.remote())  # up and answering before the app uses it
    return actor


def get_scheduler():
    """The running scheduler actor's handle (raises ValueError when there is none)."""
    return ray.get_actor(SCHEDULER_NAME, namespace=SCHEDULER_NAMESPACE)


def stop_scheduler() -> None:
    try:
        ray.kill(get_scheduler(), no_restart=True)
    except ValueError:
        pass
