"""The worker's KV event publisher against the real scheduler core, over a fake link (no Ray)."""

from __future__ import annotations

import asyncio

from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.kv_index import routing_keys
from pagefleet.worker.core.block_hash import pack_hashes
from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.kv_events import KVEventLog, KVEventSource, KVLoad, Release, pack_releases
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.replica.kv_publisher import KVEventPublisher
from pagefleet.worker.sampling_params import SamplingParams

BLOCK = 4


class Worker:
    """A pool with traffic; ``step`` changes its cache the way requests do."""

    def __init__(self, num_blocks: int = 12) -> None:
        self.pool = BlockPool(num_blocks, events=KVEventLog())
        self.kv = KVCacheManager(self.pool, BLOCK)
        self.source = KVEventSource("w", self.pool)
        self.n = 0

    def step(self):
        s = Sequence(self.n, f"r{self.n}", 0, [self.n % 3] * 4 + [self.n] * 5, SamplingParams(max_tokens=1))
        self.n += 1
        assert self.kv.allocate(s, s.num_tokens, self.kv.find_prefix(s))
        self.kv.commit_step()
        self.kv.free(s)
        return self.source.drain(KVLoad())

    async def snapshot(self):
        return self.source.snapshot(KVLoad())[1]  # the batch that goes with it is covered

    def keys(self) -> set[int]:
        return set(routing_keys(pack_hashes(self.pool.cached)))


class Link:
    """Carries calls to a real GlobalScheduler; can be held (a slow scheduler) or broken."""

    def __init__(self) -> None:
        self.core = GlobalScheduler()
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls: list[tuple[int, int]] = []
        self.broken = False

    async def publish(self, batch):
        await self.gate.wait()
        if self.broken:
            raise ConnectionError("scheduler unreachable")
        self.calls.append((batch.first_seq, batch.seq))
        return self.core.apply_batch(batch, now=0.0)

    async def publish_snapshot(self, snapshot):
        self.calls.append(("snapshot", snapshot.seq))
        self.core.apply_snapshot(snapshot, now=0.0)


async def settle(publisher):
    for _ in range(50):
        await asyncio.sleep(0)
    while publisher._pending:
        await asyncio.sleep(0.001)
    for _ in range(50):
        await asyncio.sleep(0)


def test_batches_queued_behind_a_slow_call_go_out_merged_and_in_order():
    async def run():
        worker, link = Worker(), Link()
        pub = KVEventPublisher(link, worker.snapshot, min_interval_s=0.0)
        pub.start()
        pub.put(worker.step())  # batch 0 goes out at once ...
        await settle(pub)
        link.gate.clear()  # ... then the scheduler turns slow
        pub.put(worker.step())
        await asyncio.sleep(0.01)  # batch 1 is in flight, held
        for _ in range(4):
            pub.put(worker.step())  # 2..5 pile up
        link.gate.set()
        await settle(pub)
        assert link.calls == [(0, 0), (1, 1), (2, 5)]
        assert link.core.keys_of("w") == worker.keys()
        assert (pub.counters.batches, pub.counters.calls, pub.counters.dropped) == (6, 3, 0)
        await pub.close()

    asyncio.run(run())


def test_overflow_drops_the_oldest_and_the_gap_brings_a_snapshot():
    async def run():
        worker, link = Worker(), Link()
        pub = KVEventPublisher(link, worker.snapshot, max_pending=3, min_interval_s=0.0)
        pub.start()
        pub.put(worker.step())
        await settle(pub)
        link.gate.clear()
        pub.put(worker.step())  # 1, in flight
        await asyncio.sleep(0.01)
        for _ in range(7):
            pub.put(worker.step())  # 2..8 into a buffer of 3: 2..5 are dropped
        assert pub.counters.dropped == 4
        link.gate.set()
        await settle(pub)
        # 6..8 arrive after a gap: the scheduler asks, the snapshot (taken at 9) follows
        assert link.calls == [(0, 0), (1, 1), (6, 8), ("snapshot", 9)]
        assert link.core.keys_of("w") == worker.keys()
        pub.put(worker.step())  # and batch 10 follows on
        await settle(pub)
        assert link.calls[-1] == (10, 10) and link.core.keys_of("w") == worker.keys()
        assert link.core.workers["w"].synced
        await pub.close()

    asyncio.run(run())


def test_a_failed_call_is_a_gap_that_heals_once_the_scheduler_answers():
    async def run():
        worker, link = Worker(), Link()
        pub = KVEventPublisher(link, worker.snapshot, backoff_s=0.0, min_interval_s=0.0)
        pub.start()
        pub.put(worker.step())
        await settle(pub)
        link.broken = True
        pub.put(worker.step())  # lost
        await settle(pub)
        assert pub.counters.failed_calls == 1
        link.broken = False
        pub.put(worker.step())
        await settle(pub)
        assert link.calls == [(0, 0), (2, 2), ("snapshot", 3)]
        assert link.core.keys_of("w") == worker.keys() and link.core.counters.gaps == 1
        await pub.close()

    asyncio.run(run())


def test_put_before_start_is_sent_on_start():
    async def run():
        worker, link = Worker(), Link()
        pub = KVEventPublisher(link, worker.snapshot, min_interval_s=0.0)
        pub.put(worker.step())
        pub.start()
        await settle(pub)
        assert link.calls == [(0, 0)]
        await pub.close()

    asyncio.run(run())


def test_calls_are_at_least_the_minimum_interval_apart_and_what_comes_between_goes_out_merged():
    async def run():
        worker, link = Worker(), Link()
        loop = asyncio.get_running_loop()
        sent_at = []
        publish = link.publish

        async def timed(batch):
            sent_at.append(loop.time())
            return await publish(batch)
        link.publish = timed
        pub = KVEventPublisher(link, worker.snapshot, min_interval_s=0.2)
        pub.start()
        pub.put(worker.step())  # nothing sent before: goes out at once
        await asyncio.sleep(0.01)
        for _ in range(3):
            pub.put(worker.step())  # 1..3 within the interval: held, then one call
            await asyncio.sleep(0.01)
        await settle(pub)
        assert link.calls == [(0, 0), (1, 3)]
        assert sent_at[1] - sent_at[0] >= 0.2
        assert link.core.keys_of("w") == worker.keys()
        await pub.close()

    asyncio.run(run())


def test_ready_says_whether_a_batch_put_now_would_go_out_at_once():
    async def run():
        worker, link = Worker(), Link()
        pub = KVEventPublisher(link, worker.snapshot, min_interval_s=0.2)
        assert pub.ready()  # nothing sent, nothing waiting
        pub.put(worker.step())
        assert not pub.ready()  # one waits (the sender has not started)
        pub.start()
        await settle(pub)
        assert link.calls == [(0, 0)] and not pub.ready()  # sent: the next call only 0.2 s later
        await asyncio.sleep(0.21)
        assert pub.ready()
        await pub.close()

    asyncio.run(run())


def test_batches_that_change_nothing_wait_for_one_that_does():
    async def run():
        worker, link = Worker(), Link()
        pub = KVEventPublisher(link, worker.snapshot, min_interval_s=0.0, heartbeat_s=3600)
        pub.start()
        pub.put(worker.step())  # batch 0: stores blocks
        await settle(pub)
        pub.put(worker.source.drain(KVLoad(num_running=1)))  # batch 1: the load changed
        await settle(pub)
        assert link.calls == [(0, 0), (1, 1)]
        # batches 2-6: decode steps between two block boundaries change nothing the view must hear
        # at once; their sequence's steps left count down, which a view's copy follows by the clock
        for left in range(5, 0, -1):
            pub.put(worker.source.drain(KVLoad(num_running=1, releases=pack_releases([Release(left, 1, 2)]),
                                               step_time_s=0.01)))
        for _ in range(50):
            await asyncio.sleep(0)
        assert link.calls == [(0, 0), (1, 1)] and pub.counters.quiet == 5
        pub.put(worker.step())  # batch 7 stores blocks: it goes out with the five before it
        await settle(pub)
        assert link.calls == [(0, 0), (1, 1), (2, 7)]
        assert link.core.workers["w"].num_running == 0 and link.core.counters.gaps == 0
        assert link.core.keys_of("w") == worker.keys()
        await pub.close()

    asyncio.run(run())


def test_a_quiet_worker_still_publishes_every_heartbeat():
    async def run():
        worker, link = Worker(), Link()
        pub = KVEventPublisher(link, worker.snapshot, min_interval_s=0.0, heartbeat_s=0.0)
        pub.start()
        for _ in range(3):
            pub.put(worker.source.drain(KVLoad()))
            await settle(pub)
        assert link.calls == [(0, 0), (1, 1), (2, 2)] and pub.counters.quiet == 0
        await pub.close()

    asyncio.run(run())
