"""An ingress's copy of the global scheduler's view: the feed, the mirror, the follower, without Ray.

The mirror must hold exactly what the actor's core holds (keys, counters,
sequence numbers) after any mix of batches, gaps, snapshots and drops, for a
follower that keeps up, one that joins late, one that fell out of the feed's
log, and one that meets a restarted actor (a new epoch).
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from pagefleet.router.global_scheduler.actor import worker_kv_view
from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.kv_index import pack_keys, routing_keys, unpack_keys
from pagefleet.router.global_scheduler.kv_mirror import SchedulerMirror, ViewFollower
from pagefleet.router.global_scheduler.view_feed import ViewFeed, WorkerDropped
from pagefleet.worker.core.block_hash import pack_hashes
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot

pytestmark = pytest.mark.usefixtures("kv_index_kind")

WORKERS = ("w0", "w1", "w2")


def h(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"\x5a" * 8


def batch(worker, first_seq, seq, stored=(), removed=(), *, cleared=False, free=50, total=64, running=1,
          waiting=0, reserved=2, added=()):
    return KVEventBatch(worker, first_seq, seq, cleared, pack_hashes(map(h, stored)),
                        pack_hashes([b"\0" * 16] * len(stored)), bytes(4 * 4 * len(stored)),
                        pack_hashes(map(h, removed)), free, total, running, waiting, reserved, list(added))


class Actor:
    """The actor's bookkeeping without Ray: its core, and every input appended to its feed."""

    def __init__(self, epoch="e1", max_entries=10_000, max_bytes=64 << 20):
        self.core = GlobalScheduler()
        self.feed = ViewFeed(epoch, max_entries=max_entries, max_bytes=max_bytes)

    def publish(self, b, now=0.0):
        self.core.apply_batch(b, now)
        self.feed.append(b)

    def snapshot(self, s, now=0.0):
        self.core.apply_snapshot(s, now)
        self.feed.append(s)

    def drop(self, worker):
        self.core.drop_worker(worker)
        self.feed.append(WorkerDropped(worker))

    def update_for(self, mirror):
        return self.feed.update_since(mirror.epoch, mirror.cursor, self.core)


class Traffic:
    """Batches with churn, lost batches (gaps) answered by snapshots, drops and comebacks."""

    def __init__(self, actor: Actor, seed: int) -> None:
        self.actor = actor
        self.rng = random.Random(seed)
        self.held = {w: set() for w in WORKERS}
        self.seq = {w: -1 for w in WORKERS}
        self.step = 0

    def next(self) -> None:
        actor, rng, held, step = self.actor, self.rng, self.held, self.step
        self.step += 1
        w = rng.choice(WORKERS)
        stored = [k for k in rng.sample(range(200), rng.randrange(0, 6)) if k not in held[w]]
        removed = rng.sample(sorted(held[w]), min(len(held[w]), rng.randrange(0, 4)))
        held[w] = (held[w] - set(removed)) | set(stored)
        self.seq[w] += 1
        seq = self.seq[w]
        b = batch(w, seq, seq, stored, removed, free=64 - len(held[w]), running=rng.randrange(4),
                  added=[f"r{step}"])
        if step % 37 == 5:
            return  # lost on the way: the worker's next batch shows a gap
        actor.publish(b)
        view = actor.core.workers.get(w)
        if view is not None and not view.synced:
            actor.snapshot(KVSnapshot(w, seq, pack_hashes(map(h, sorted(held[w]))), 64 - len(held[w]), 64, 0, 0, 0))
        if step % 53 == 40:
            actor.drop(w)  # its next batch comes back as a gap, repaired by a snapshot


def assert_same_view(core_a: GlobalScheduler, core_b: GlobalScheduler) -> None:
    assert sorted(core_a.workers) == sorted(core_b.workers)
    for w in core_a.workers:
        a, b = core_a.workers[w], core_b.workers[w]
        assert worker_kv_view(core_a, w) == worker_kv_view(core_b, w)
        assert (a.num_running, a.num_waiting, a.num_reserved_blocks) == (b.num_running, b.num_waiting,
                                                                        b.num_reserved_blocks)


def test_pack_keys_round_trips_little_endian():
    keys = [0, 1, 2**64 - 1, 0x0102030405060708]
    packed = pack_keys(keys)
    assert len(packed) == 32 and packed[24:] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert unpack_keys(packed) == keys


@pytest.mark.parametrize("poll_every", [1, 7, 1000])
def test_a_mirror_following_the_feed_holds_exactly_the_actors_view(poll_every):
    actor = Actor()
    traffic = Traffic(actor, seed=poll_every)
    mirror = SchedulerMirror(weight=4.0)
    for i in range(600):
        traffic.next()
        if i % poll_every == 0:
            mirror.apply(actor.update_for(mirror), now=float(i))
    mirror.apply(actor.update_for(mirror), now=600.0)
    counters = actor.core.counters
    assert counters.gaps > 0 and counters.snapshots_applied > 0 and counters.workers_dropped > 0
    assert_same_view(actor.core, mirror.core)
    assert mirror.cursor == actor.feed.cursor
    # only the first update was a whole view; everything after came as entries
    assert mirror.counters.resyncs == 1


def test_a_follower_that_fell_out_of_the_log_or_meets_a_new_epoch_gets_the_whole_view():
    actor = Actor(max_entries=4)
    mirror = SchedulerMirror(weight=4.0)
    actor.publish(batch("w0", 0, 0, stored=[1, 2]))
    mirror.apply(actor.update_for(mirror), now=0.0)
    for s in range(1, 8):  # 7 more entries: more than the log keeps
        actor.publish(batch("w0", s, s, stored=[10 + s]))
    update = actor.update_for(mirror)
    assert update.states is not None and update.entries == []
    mirror.apply(update, now=1.0)
    assert mirror.core.keys_of("w0") == set(routing_keys(pack_hashes(map(h, [1, 2, *range(11, 18)]))))
    assert mirror.counters.resyncs == 2
    # the actor restarts: a new epoch, an empty view, then w1 only (w0 has not been heard from)
    restarted = Actor(epoch="e2")
    restarted.publish(batch("w1", 0, 0, stored=[5]))
    update = restarted.update_for(mirror)
    assert update.states is not None and update.epoch == "e2"
    mirror.apply(update, now=2.0)
    assert sorted(mirror.core.workers) == ["w1"] and mirror.epoch == "e2"
    assert_same_view(restarted.core, mirror.core)


def test_the_feed_keeps_a_bounded_number_of_bytes_and_a_follower_behind_them_gets_the_whole_view():
    actor = Actor(max_bytes=100)  # 16-byte hashes: six of them
    mirror = SchedulerMirror(weight=4.0)
    actor.publish(batch("w0", 0, 0, stored=[1]))
    mirror.apply(actor.update_for(mirror), now=0.0)
    actor.publish(batch("w0", 1, 1, stored=[2, 3]))
    actor.publish(batch("w0", 2, 2, stored=[4, 5, 6]))
    assert actor.feed.kept_bytes == 96  # all kept: a follower at entry 0 gets just the two after it
    assert len(actor.update_for(mirror).entries) == 2
    actor.publish(batch("w0", 3, 3, stored=[7, 8]))  # 128 bytes: the two oldest entries go
    assert actor.feed.kept_bytes == 80
    update = actor.update_for(mirror)
    assert update.states is not None and update.entries == []
    mirror.apply(update, now=1.0)
    assert_same_view(actor.core, mirror.core)
    actor.snapshot(KVSnapshot("w0", 4, pack_hashes(map(h, range(20))), 40, 64, 0, 0, 0))  # 320 bytes alone
    assert actor.feed.kept_bytes == 320  # the newest entry always stays
    (entry,) = actor.update_for(mirror).entries
    assert entry.seq == 4


def test_the_feed_slims_batches_and_answers_nothing_new_when_current():
    actor = Actor()
    actor.publish(batch("w0", 0, 0, stored=[1, 2]))
    mirror = SchedulerMirror(weight=4.0)
    mirror.apply(actor.update_for(mirror), now=0.0)
    assert not actor.feed.has_news(mirror.epoch, mirror.cursor)
    actor.publish(batch("w0", 1, 1, stored=[3]))
    (entry,) = actor.update_for(mirror).entries
    assert (entry.stored, entry.stored_parents, entry.stored_token_ids) == (pack_hashes([h(3)]), b"", b"")


def test_the_mirrors_own_predictions_end_when_the_worker_reports_the_request():
    from pagefleet.router.global_scheduler.views import RouteRequest

    actor = Actor()
    for w in ("w0", "w1"):
        actor.publish(batch(w, 0, 0, free=12, running=0, reserved=0))
    mirror = SchedulerMirror(weight=4.0)
    mirror.apply(actor.update_for(mirror), now=0.0)
    first = mirror.core.route(RouteRequest("a", b"", 10), now=0.0)
    assert first.ranking == ["w0", "w1"] and first.admitted
    second = mirror.core.route(RouteRequest("b", b"", 10), now=0.0)  # w0 has 2 of 12 left
    assert second.ranking == ["w1"] and second.admitted
    third = mirror.core.route(RouteRequest("c", b"", 10), now=0.0)  # nobody has 10 blocks left
    assert not third.admitted and third.reason == "no_room"
    assert actor.core.workers["w0"].predicted_blocks == 0  # predictions live in the copy only
    # w0 reports a taken in and already finished (12 free again): a's prediction ends there
    actor.publish(batch("w0", 1, 1, free=12, running=0, reserved=0, added=["a"]))
    mirror.apply(actor.update_for(mirror), now=0.1)
    assert mirror.core.workers["w0"].predicted_blocks == 0
    assert mirror.core.route(RouteRequest("c", b"", 10), now=0.1).ranking == ["w0"]


class FakeLink:
    def __init__(self, actor: Actor):
        self.actor = actor
        self.fail = False
        self.calls = 0

    async def updates(self, epoch, cursor, wait_s):
        self.calls += 1
        if self.fail:
            raise ConnectionError("the actor died")
        return self.actor.feed.update_since(epoch, cursor, self.actor.core)


def following(link_class, **options):
    """(link, clock, mirror, follower) over an actor that holds one batch; the clock starts at 10."""
    actor = Actor()
    actor.publish(batch("w0", 0, 0, stored=[1]))
    link, clock, mirror = link_class(actor), [10.0], SchedulerMirror(weight=4.0)
    return link, clock, mirror, ViewFollower(link, mirror, clock=lambda: clock[0], **options)


def test_the_follower_counts_failed_polls_and_the_mirror_ages():
    link, clock, mirror, follower = following(FakeLink)

    async def run():
        assert await follower.poll_once(wait_s=0)
        assert mirror.age(10.0) == 0.0 and mirror.cursor == 0
        link.fail = True
        clock[0] = 12.5
        assert not await follower.poll_once(wait_s=0)
        assert mirror.counters.failed_polls == 1 and mirror.age(clock[0]) == 2.5
        link.fail = False
        assert await follower.poll_once(wait_s=0)
        assert mirror.age(clock[0]) == 0.0

    asyncio.run(run())
    assert math.isinf(SchedulerMirror(weight=1.0).age(0.0))  # never synced: infinitely stale


class HeldLink:
    """A feed whose polls wait until the test answers (``reply``) or fails (``fail``) them."""

    def __init__(self, actor: Actor):
        self.actor = actor
        self.pending: asyncio.Future | None = None
        self.waits: list[float] = []

    async def updates(self, epoch, cursor, wait_s):
        self.waits.append(wait_s)
        self.pending = asyncio.get_running_loop().create_future()
        await self.pending
        return self.actor.feed.update_since(epoch, cursor, self.actor.core)

    def reply(self):
        self.pending.set_result(None)

    def fail(self):
        self.pending.set_exception(ConnectionError("the actor died"))


def test_a_poll_waiting_right_after_a_reply_keeps_the_copy_current_until_its_wait_is_over():
    link, clock, mirror, follower = following(HeldLink, poll_wait_s=2.0)

    async def poll():
        task = asyncio.create_task(follower.poll_once())
        while link.pending is None or link.pending.done():  # until the poll is sent and waits
            await asyncio.sleep(0)
        return task

    async def run():
        first = await poll()  # the first poll follows no reply: it vouches for nothing
        assert math.isinf(mirror.age(10.5))  # never synced
        clock[0] = 11.0
        link.reply()
        assert await first and mirror.age(11.0) == 0.0
        clock[0] = 11.1
        second = await poll()  # sent at 11.1, waits up to 2 s: the copy is current until 13.1
        assert mirror.age(11.1) == 0.0 and mirror.age(13.0) == 0.0
        assert mirror.age(13.6) == pytest.approx(0.5)  # past the wait and still no answer: it ages from 13.1
        clock[0] = 13.7
        link.reply()  # a late answer, nothing new
        assert await second and mirror.age(13.7) == 0.0
        third = await poll()  # sent at 13.7: vouches until 15.7
        assert mirror.age(14.9) == 0.0
        clock[0] = 15.0
        link.fail()  # the actor died, some time during the wait
        assert not await third
        assert mirror.age(15.0) == pytest.approx(1.3)  # the copy's age counts from the last reply again
        fourth = await poll()  # follows a failure, not a reply: vouches for nothing
        assert mirror.age(15.5) == pytest.approx(1.8)
        clock[0] = 15.5
        link.reply()  # the restarted actor answers
        assert await fourth and mirror.age(15.5) == 0.0
        fifth = await poll()  # vouches until 17.5
        fifth.cancel()  # the follower closing mid-poll takes it back too
        with pytest.raises(asyncio.CancelledError):
            await fifth
        assert mirror.age(16.0) == pytest.approx(0.5)
        assert link.waits == [2.0] * 5

    asyncio.run(run())
