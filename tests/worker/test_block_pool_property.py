"""Block pool and scheduler invariants under random operation sequences (no model)."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagefleet.worker.core.block_hash import unpack_hashes
from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.kv_events import KVEventLog, KVEventSource, KVLoad
from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence, SequenceStatus
from pagefleet.worker.sampling_params import SamplingParams

BLOCK = 4


def test_free_queue_is_lru_and_eviction_forgets_hash():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    assert [a.block_id, b.block_id, c.block_id] == [0, 1, 2]
    pool.cache(b, b"h1")
    pool.free([c, b, a])  # tail first
    assert [blk.block_id for blk in pool.free_queue] == [3, 2, 1, 0]
    assert pool.lookup(b"h1") is b
    pool.touch([b])  # a cache hit takes the idle block out of the queue
    assert b.ref_cnt == 1 and pool.num_free == 3
    pool.free([b])
    assert [blk.block_id for blk in pool.free_queue] == [3, 2, 0, 1]
    got = pool.allocate(4)
    assert [blk.block_id for blk in got] == [3, 2, 0, 1]
    assert pool.lookup(b"h1") is None and b.block_hash is None  # evicted on reuse
    assert pool.num_evicted == 1


def test_prefix_hit_never_covers_last_token():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, BLOCK)
    p = SamplingParams(max_tokens=4)
    first = Sequence(0, "a", 0, list(range(8)), p)
    assert kv.allocate(first, 8, kv.find_prefix(first))
    same = Sequence(1, "b", 0, list(range(8)), p)
    hit = kv.find_prefix(same)
    assert hit.num_tokens == 4  # 8 tokens = 2 full blocks, but the last token must be computed
    assert [b.block_id for b in hit.blocks] == kv.block_ids(first)[:1]
    longer = Sequence(2, "c", 0, list(range(9)), p)
    assert kv.find_prefix(longer).num_tokens == 8


class PoolMachine(RuleBasedStateMachine):
    """Random add / schedule-and-compute / abort / finish / prefix-hit traffic through the real
    scheduler and KV manager; after every step each block is either free or referenced, every
    ref count equals the number of block tables holding it, and nothing leaks. A consumer of
    the pool's KV events, draining at random points, always ends up with the pool's exact
    set of cached hashes, and the undrained log never exceeds two entries per block."""

    SLIDING_WINDOW: int | None = None  # the KV manager's window (every layer sliding)

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(10, enable_caching=True, events=KVEventLog())  # small enough to force preemption
        self.source = KVEventSource("w", self.pool)
        self.view: set = set()
        self.in_use: set = set()  # the consumer's view of which cached hashes are in use
        self.kv = KVCacheManager(self.pool, BLOCK, self.SLIDING_WINDOW)
        self.sched = Scheduler(self.kv, max_num_seqs=5, max_num_batched_tokens=12)
        self.seqs: list[Sequence] = []
        self.next_id = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 50), min_size=1, max_size=14), n=st.integers(1, 3))
    def add(self, prefix, tail, n):
        params = SamplingParams(n=n, max_tokens=8)
        parent = None
        for i in range(n):
            seq = Sequence(self.next_id, f"r{self.next_id}", i, prefix + tail, params, parent=parent)
            parent = parent or seq
            self.next_id += 1
            self.sched.add(seq)
            self.seqs.append(seq)

    @rule(tokens=st.lists(st.integers(0, 50), min_size=8, max_size=8))
    def step(self, tokens):
        out = self.sched.schedule()
        for item, tok in zip(out.scheduled, tokens):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            assert seq.num_computed_tokens <= seq.num_tokens
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(tok)  # the "sampled" token
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.finish(seq, "length")

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        live = [s for s in self.seqs if not s.is_finished]
        self.sched.finish(live[pick % len(live)], "abort")

    @rule()
    def reset_cache(self):
        self.pool.reset_prefix_cache()

    @rule()
    def drain_events(self):
        batch = self.source.drain(KVLoad())
        if batch.cleared:
            self.view.clear()
        removed, stored = set(unpack_hashes(batch.removed)), unpack_hashes(batch.stored)
        assert removed <= self.view and not removed & set(stored) and not self.view & set(stored)
        self.view -= removed
        self.view.update(stored)
        assert self.view == set(self.pool.cached)
        # which cached hashes a running sequence holds: stored ones are, then each hash's last state
        acquired, released = set(unpack_hashes(batch.acquired)), set(unpack_hashes(batch.released))
        assert not acquired & released and (acquired | released) <= self.view
        if batch.cleared:
            self.in_use.clear()
        self.in_use = ((self.in_use - removed) | set(stored) | acquired) - released
        assert self.in_use == {h for h, b in self.pool.cached.items() if b.ref_cnt > 0}
        assert batch.num_free_blocks == self.pool.num_free

    @invariant()
    def event_log_bounded(self):
        assert len(self.pool.events) <= 2 * self.pool.num_blocks

    @invariant()
    def blocks_accounted(self):
        refs = Counter(b.block_id for seq_id in self.kv.block_tables for b in self.kv.held_blocks(seq_id))
        free_ids = {b.block_id for b in self.pool.free_queue}
        assert len(free_ids) == self.pool.num_free
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), block
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), block
        for h, block in self.pool.cached.items():
            assert block.block_hash == h
        for seq in self.seqs:
            if seq.status is SequenceStatus.RUNNING:
                assert len(self.kv.block_tables[seq.seq_id]) * BLOCK >= seq.num_computed_tokens
            else:
                assert seq.seq_id not in self.kv.block_tables

    def teardown(self):
        for seq in self.seqs:
            self.sched.finish(seq, "abort")
        assert self.pool.num_free == self.pool.num_blocks
        assert not self.kv.block_tables


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedPoolMachine(PoolMachine):
    """The same traffic with a 6-token window in every layer: blocks that leave a sequence's
    window go back to the pool while it runs, and the accounting above still holds over the
    blocks each sequence still holds."""

    SLIDING_WINDOW = 6

    @invariant()
    def windows_bounded(self):
        for seq in self.seqs:
            if seq.status is SequenceStatus.RUNNING:
                held = self.kv.held_blocks(seq.seq_id)
                skipped = len(self.kv.block_tables[seq.seq_id]) - len(held)
                # Never a block a later query reads; at most the window and one step's 12 tokens held.
                assert skipped <= self.kv.num_skipped_blocks(seq.num_computed_tokens)
                assert len(held) <= -(-(self.SLIDING_WINDOW - 1 + 12) // BLOCK) + 1


TestWindowedPoolMachine = WindowedPoolMachine.TestCase
TestWindowedPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
