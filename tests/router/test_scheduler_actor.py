"""The global scheduler actor's own methods, on the class without Ray."""

from __future__ import annotations

import asyncio
import time

from pagefleet.router.global_scheduler.actor import GlobalSchedulerActor
from pagefleet.router.global_scheduler.view_feed import WorkerDropped
from pagefleet.worker.core.kv_events import KVSnapshot


def _snapshot(worker_id: str) -> KVSnapshot:
    return KVSnapshot(worker_id, 1, b"", 10, 10, 0, 0, 0)


def test_worker_ids_names_the_workers_in_the_view_once_a_silent_one_and_a_dropped_one_left_it():
    async def scenario() -> None:
        actor = GlobalSchedulerActor()
        await actor.publish_snapshot(_snapshot("a"))
        await actor.publish_snapshot(_snapshot("b"))
        # "c" last heard from longer ago than the liveness timeout: the call drops it first
        actor.core.apply_snapshot(_snapshot("c"), time.monotonic() - actor.core.liveness_timeout_s - 1)
        assert set(actor.core.workers) == {"a", "b", "c"}
        assert await actor.worker_ids() == {"a", "b"}
        assert await actor.drop_worker("b") is True
        assert await actor.worker_ids() == {"a"}
        entries = actor.feed.update_since(actor.feed.epoch, -1, actor.core).entries
        assert [e.worker_id for e in entries if isinstance(e, WorkerDropped)] == ["c", "b"]  # what copies follow
        assert actor.core.counters.workers_dropped == 2

    asyncio.run(scenario())
