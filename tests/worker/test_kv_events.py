"""KV events from the block pool: exact contents, coalescing, bounds, merging, snapshots (no model)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagefleet.worker.core.block_hash import ROOT_HASH, block_hashes, hash_block
from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.kv_events import (
    KVEventBatch,
    KVEventLog,
    KVEventSource,
    KVLoad,
    merge_batches,
    pack_hashes,
    unpack_hashes,
    unpack_token_ids,
)
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.sampling_params import SamplingParams

BLOCK = 4


def make(num_blocks: int = 8):
    pool = BlockPool(num_blocks, events=KVEventLog())
    return pool, KVCacheManager(pool, BLOCK), KVEventSource("w0", pool)


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(max_tokens=4))


def run_prompt(kv: KVCacheManager, s: Sequence) -> None:
    assert kv.allocate(s, s.num_tokens, kv.find_prefix(s))
    kv.commit_step()


def apply(view: set, batch: KVEventBatch, in_use: set | None = None) -> None:
    """What a consumer does with a batch: the cached hashes, and (``in_use``) those in use."""
    if batch.cleared:
        view.clear()
    view.difference_update(unpack_hashes(batch.removed))
    view.update(unpack_hashes(batch.stored))
    if in_use is not None:
        if batch.cleared:
            in_use.clear()
        in_use.difference_update(unpack_hashes(batch.removed))
        in_use.update(unpack_hashes(batch.stored))
        in_use.update(unpack_hashes(batch.acquired))
        in_use.difference_update(unpack_hashes(batch.released))


def in_use_of(pool: BlockPool) -> set:
    return {h for h, block in pool.cached.items() if block.ref_cnt > 0}


def test_stored_blocks_carry_parent_and_tokens_in_order():
    pool, kv, source = make()
    s = seq(0, list(range(10)))  # two full blocks and two tokens
    run_prompt(kv, s)
    h = block_hashes(s.token_ids, BLOCK)
    batch = source.drain(KVLoad(num_running=1, num_waiting=2, num_reserved_blocks=3))
    assert (batch.worker_id, batch.first_seq, batch.seq, batch.cleared) == ("w0", 0, 0, True)
    assert unpack_hashes(batch.stored) == h
    assert unpack_hashes(batch.stored_parents) == [ROOT_HASH, h[0]]
    assert unpack_token_ids(batch.stored_token_ids) == list(range(8))
    assert batch.removed == b""
    assert (batch.num_free_blocks, batch.num_total_blocks) == (5, 8)  # 3 blocks hold 10 tokens
    assert (batch.num_running, batch.num_waiting, batch.num_reserved_blocks) == (1, 2, 3)
    nothing = source.drain(KVLoad())
    assert (nothing.seq, nothing.cleared, nothing.stored, nothing.removed) == (1, False, b"", b"")


def test_eviction_reports_removed_hashes():
    pool, kv, source = make(num_blocks=3)
    a = seq(0, list(range(9)))  # 3 blocks, 2 of them hashed
    run_prompt(kv, a)
    kv.free(a)
    source.drain(KVLoad())
    b = seq(1, [50, 51])  # allocates the LRU free block: a's tail block (unhashed) goes first
    run_prompt(kv, b)
    assert source.drain(KVLoad()).removed == b""
    c = seq(2, [60, 61, 62, 63, 64])  # needs two more: evicts a's second then first block
    run_prompt(kv, c)
    batch = source.drain(KVLoad())
    ha = block_hashes(a.token_ids, BLOCK)
    assert unpack_hashes(batch.removed) == [ha[1], ha[0]]
    assert unpack_hashes(batch.stored) == block_hashes(c.token_ids, BLOCK)
    assert pool.num_evicted == 2


def test_cached_then_evicted_before_a_drain_never_shows_and_evicted_then_cached_is_no_change():
    pool, kv, source = make(num_blocks=2)
    a = seq(0, [1, 2, 3, 4, 5])
    run_prompt(kv, a)
    kv.free(a)
    b = seq(1, [7, 7, 7, 7, 7])  # evicts a's block before anyone drained
    run_prompt(kv, b)
    batch = source.drain(KVLoad())
    assert unpack_hashes(batch.stored) == block_hashes(b.token_ids, BLOCK)
    assert batch.removed == b""
    kv.free(b)
    c = seq(2, [9, 9, 9, 9, 9])  # evicts b's hashed block ...
    run_prompt(kv, c)
    kv.free(c)
    d = seq(3, [7, 7, 7, 7, 7])  # ... and b's prompt comes back, hashed again
    run_prompt(kv, d)
    batch = source.drain(KVLoad())
    # b's hash went out and came back: the consumer's view already has it. c's went in and out.
    assert set(unpack_hashes(batch.removed)) == set()
    assert unpack_hashes(batch.stored) == []
    assert set(pool.cached) == set(block_hashes(b.token_ids, BLOCK))


def test_withdrawn_after_a_failed_step_is_removed_once_reported():
    pool, kv, source = make()
    a = seq(0, list(range(8)))
    assert kv.allocate(a, 8, kv.find_prefix(a))
    kv.unpublish_step()  # the step failed before anyone drained: nothing to report
    assert source.drain(KVLoad()).stored == b""
    assert kv.allocate(a, 8)  # the retry (same blocks) republishes
    kv.commit_step()
    first = source.drain(KVLoad())
    assert unpack_hashes(first.stored) == block_hashes(a.token_ids, BLOCK)
    b = seq(1, list(range(8)) + [100, 101, 102, 103, 104])
    assert kv.allocate(b, 13 - 4, kv.find_prefix(b))  # prefix hit on a's first block, publishes b's 3rd
    source.drain(KVLoad())  # a scheduler saw b's third block ...
    kv.unpublish_step()  # ... then that step failed
    assert unpack_hashes(source.drain(KVLoad()).removed) == [block_hashes(b.token_ids, BLOCK)[2]]


def test_reset_with_everything_idle_is_one_clear():
    pool, kv, source = make()
    a = seq(0, list(range(9)))
    run_prompt(kv, a)
    source.drain(KVLoad())
    kv.free(a)
    pool.reset_prefix_cache()
    batch = source.drain(KVLoad())
    assert (batch.cleared, batch.removed, batch.stored) == (True, b"", b"")
    b = seq(1, list(range(20, 29)))
    run_prompt(kv, b)
    pool.reset_prefix_cache()  # b still holds its blocks: only idle hashes go, one by one
    batch = source.drain(KVLoad())
    assert not batch.cleared and batch.removed == b""
    assert unpack_hashes(batch.stored) == block_hashes(b.token_ids, BLOCK)


def test_log_stays_bounded_without_a_consumer():
    pool, kv, source = make(num_blocks=6)
    for i in range(500):  # 500 distinct prompts churn through 6 blocks, nobody drains
        s = seq(i, [i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7, i])
        run_prompt(kv, s)
        kv.free(s)
        assert len(pool.events) <= 2 * pool.num_blocks
    view: set = set()
    apply(view, source.drain(KVLoad()))
    assert view == set(pool.cached)


def test_merge_equals_applying_each_batch():
    pool, kv, source = make(num_blocks=10)
    view_each: set = set()
    in_use_each: set = set()
    batches = []
    live = []
    for i in range(12):
        s = seq(i, [i % 5] * 4 + [i] * 5)
        run_prompt(kv, s)
        live.append(s)
        if i % 4:
            kv.free(live.pop())
        if i == 7:  # everything idle, then cleared
            while live:
                kv.free(live.pop())
            pool.reset_prefix_cache()
        batch = source.drain(KVLoad(num_running=i))
        apply(view_each, batch, in_use_each)
        batches.append(batch)
    assert any(b.cleared for b in batches[2:]) and any(b.removed for b in batches[2:])
    merged = merge_batches(batches[2:])
    assert (merged.first_seq, merged.seq, merged.num_running) == (2, 11, 11)
    view_merged: set = set()
    in_use_merged: set = set()
    for b in batches[:2]:
        apply(view_merged, b, in_use_merged)
    apply(view_merged, merged, in_use_merged)
    assert view_merged == view_each == set(pool.cached)
    assert in_use_merged == in_use_each == in_use_of(pool) != set()
    assert any(b.released for b in batches)
    # each stored hash still travels with its own parent and tokens
    for i, (h, parent) in enumerate(zip(unpack_hashes(merged.stored), unpack_hashes(merged.stored_parents))):
        assert hash_block(parent, unpack_token_ids(merged.stored_token_ids)[i * BLOCK:(i + 1) * BLOCK]) == h
    with pytest.raises(ValueError, match="not consecutive"):
        merge_batches([batches[0], batches[2]])


def test_snapshot_lines_up_with_the_batch_numbers():
    pool, kv, source = make()
    a = seq(0, list(range(9)))
    run_prompt(kv, a)
    source.drain(KVLoad())  # seq 0
    b = seq(1, list(range(30, 39)))
    run_prompt(kv, b)  # pending, not drained
    batch, snap = source.snapshot(KVLoad(num_running=2))
    assert snap.seq == batch.seq == 1  # the pending changes went into batch 1, which the snapshot covers
    assert unpack_hashes(batch.stored) == block_hashes(b.token_ids, BLOCK)
    assert set(unpack_hashes(snap.block_hashes)) == set(pool.cached)
    assert set(unpack_hashes(snap.in_use_hashes)) == in_use_of(pool) == set(pool.cached)  # a and b still run
    assert (snap.num_free_blocks, snap.num_total_blocks, snap.num_running) == (2, 8, 2)
    after = source.drain(KVLoad())
    assert (after.seq, after.stored, after.removed) == (2, b"", b"")
    assert pack_hashes([]) == b""
    with pytest.raises(ValueError, match="multiple of 16"):
        unpack_hashes(b"abc")


def test_a_cached_prefix_reports_idle_when_released_and_in_use_when_reused_by_another():
    pool, kv, source = make()
    a = seq(0, list(range(9)))  # 2 full blocks cached
    run_prompt(kv, a)
    prefix = block_hashes(a.token_ids, BLOCK)
    first = source.drain(KVLoad())
    assert unpack_hashes(first.stored) == prefix and (first.acquired, first.released) == (b"", b"")  # stored: in use
    kv.free(a)
    released = source.drain(KVLoad())
    assert set(unpack_hashes(released.released)) == set(prefix) and released.acquired == b""
    b = seq(1, list(range(8)) + [50, 51, 52])  # reuses both idle blocks
    run_prompt(kv, b)
    reused = source.drain(KVLoad())
    assert set(unpack_hashes(reused.acquired)) == set(prefix) and reused.released == b""
    c = seq(2, list(range(8)) + [60])  # shares them while b holds them: no change of state
    run_prompt(kv, c)
    assert (source.drain(KVLoad()).acquired, source.drain(KVLoad()).released) == (b"", b"")
    kv.free(b)
    kv.free(c)
    view, in_use = set(), set()
    for batch in (first, released, reused):
        apply(view, batch, in_use)
    apply(view, source.drain(KVLoad()), in_use)
    assert in_use == in_use_of(pool) == set() and view == set(pool.cached)


def test_released_and_reused_before_a_drain_nets_to_the_last_state():
    pool, kv, source = make()
    a = seq(0, list(range(9)))
    run_prompt(kv, a)
    source.drain(KVLoad())
    kv.free(a)
    b = seq(1, list(range(9)))
    run_prompt(kv, b)  # released, then acquired again before anyone drained
    batch = source.drain(KVLoad())
    prefix = set(block_hashes(a.token_ids, BLOCK))
    assert set(unpack_hashes(batch.acquired)) == prefix and batch.released == b""


def test_a_batch_pickles_to_an_equal_batch_with_every_field():
    batch = KVEventBatch("w3", 7, 9, True, b"s" * 32, b"p" * 32, b"t" * 16, b"r" * 16, 5, 64, 2, 1, 9, ["a", "b"],
                         b"q" * 16, b"u" * 16, b"rel", 0.25)
    blank = KVEventBatch("", 0, 0, False)
    assert all(getattr(batch, f.name) != getattr(blank, f.name) for f in dataclasses.fields(batch))  # none default
    for protocol in (2, 5):
        copy = pickle.loads(pickle.dumps(batch, protocol=protocol))
        assert copy == batch and copy.added is not batch.added
