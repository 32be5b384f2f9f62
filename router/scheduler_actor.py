"""The global scheduler as a named Ray actor: a thin shell around ``GlobalScheduler``.

One per cluster (name ``SCHEDULER_NAME`` in namespace ``SCHEDULER_NAMESPACE``),
started by the app builder, detached so it outlives the process that built the
app (``serve run --non-blocking``, ``serve deploy``), restarted by Ray if it
dies. Workers publish KV event batches to it; ingress replicas ask it where
requests should go. A restarted actor starts empty: the first batch from each
worker shows a gap and the worker answers with a snapshot, so the view rebuilds
itself within a publish period. Calls run one at a time (the core is not
thread-safe and needs no lock that way).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray

from pagefleet.router.global_scheduler import GlobalScheduler, RouteDecision, RouteRequest, SchedulerCounters
from pagefleet.worker.kv_events import KVEventBatch, KVSnapshot

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


class GlobalSchedulerActor:
    def __init__(self, weight: float) -> None:
        self.core = GlobalScheduler(weight=weight)
        self.started_at = time.time()

    def configure(self, weight: float) -> None:
        """A redeployed app may bring another cost weight; the view stays."""
        self.core.weight = weight

    def publish(self, batch: KVEventBatch) -> bool:
        now = time.monotonic()
        self.core.expire(now)
        return self.core.apply_batch(batch, now)

    def publish_snapshot(self, snapshot: KVSnapshot) -> None:
        self.core.apply_snapshot(snapshot, time.monotonic())

    def route(self, request: RouteRequest, force: bool = False) -> RouteDecision:
        return self.core.route(request, time.monotonic(), force=force)

    def drop_worker(self, worker_id: str) -> bool:
        return self.core.drop_worker(worker_id)

    def worker_view(self, worker_id: str) -> WorkerKVView | None:
        view = self.core.workers.get(worker_id)
        if view is None:
            return None
        return WorkerKVView(worker_id, view.seq, view.synced, self.core.keys_of(worker_id) or set(),
                            view.num_free_blocks, view.num_total_blocks)

    def counters(self) -> SchedulerCounters:
        return self.core.counters

    def start_time(self) -> float:
        """When this incarnation started (a restart shows as a later time)."""
        return self.started_at


def start_scheduler(weight: float):
    """The cluster's scheduler actor, started if it is not running (and given ``weight``)."""
    actor = ray.remote(GlobalSchedulerActor).options(
        name=SCHEDULER_NAME, namespace=SCHEDULER_NAMESPACE, get_if_exists=True, lifetime="detached",
        max_restarts=-1, num_cpus=0).remote(weight)
    ray.get(actor.configure.remote(weight))
    return actor


def get_scheduler():
    """The running scheduler actor's handle (raises ValueError when there is none)."""
    return ray.get_actor(SCHEDULER_NAME, namespace=SCHEDULER_NAMESPACE)


def stop_scheduler() -> None:
    try:
        ray.kill(get_scheduler(), no_restart=True)
    except ValueError:
        pass
