"""vLLM's --scheduling-policy in the scheduler: under priority, waiting sequences are admitted by
(priority, arrival) and the running sequence with the highest (priority, arrival) is preempted
when blocks run out, even one scheduled earlier in the same step; under fcfs, arrival order and
the newest running sequence."""

from __future__ import annotations

import pytest

from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.request_queue import FCFSQueue, PriorityQueue, waiting_queue
from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence, SequenceStatus
from pagefleet.worker.sampling_params import SamplingParams

BS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _seq(seq_id: int, priority: int, prompt_len: int = BS) -> Sequence:
    # Distinct tokens per sequence: no prefix is shared.
    return Sequence(seq_id, f"r{seq_id}", 0, [100 * seq_id + t for t in range(prompt_len)], PARAMS,
                    priority=priority)


def _step(sched: Scheduler, kv: KVCacheManager) -> list[tuple[int, int]]:
    """Schedule and run one step: every scheduled sequence computes its tokens, and each one that
    samples gets token 7. Returns (seq_id, num_new_tokens) as scheduled."""
    out = sched.schedule()
    sched.advance(out)
    kv.commit_step()
    for seq in out.sampled_seqs():
        seq.append_token(7)
    return [(item.seq.seq_id, item.num_new_tokens) for item in out.scheduled]


@pytest.mark.parametrize("policy, order", [("priority", [2, 4, 0, 1, 3]), ("fcfs", [0, 1, 2, 3, 4])])
def test_waiting_sequences_are_admitted_by_priority_then_arrival(policy, order):
    kv = KVCacheManager(BlockPool(32, False), BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, policy=policy)
    for seq_id, priority in enumerate([0, 5, -1, 5, -1]):
        sched.add(_seq(seq_id, priority))
    assert [s.seq_id for s in sched.waiting] == order
    assert _step(sched, kv) == [(i, BS) for i in order]
    assert [s.seq_id for s in sched.running] == order


def test_one_seat_goes_to_the_best_priority_waiting_whenever_it_frees():
    kv = KVCacheManager(BlockPool(32, False), BS)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    low = [_seq(i, 10) for i in range(3)]
    for seq in low:
        sched.add(seq)
    assert _step(sched, kv) == [(0, BS)]
    sched.add(_seq(3, 1))  # arrives last, with a lower value: next once the seat frees
    assert _step(sched, kv) == [(0, 1)]  # no preemption to make a seat: the running one goes on
    sched.finish(low[0], "length")
    assert _step(sched, kv) == [(3, BS)]
    assert [s.seq_id for s in sched.waiting] == [1, 2]


def test_the_best_waiting_sequence_that_does_not_fit_blocks_the_ones_behind_it():
    kv = KVCacheManager(BlockPool(4, False), BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, policy="priority")
    sched.add(_seq(0, 0, prompt_len=2 * BS))
    assert _step(sched, kv) == [(0, 2 * BS)]  # 2 of the 4 blocks
    sched.add(_seq(1, 0, prompt_len=3 * BS))  # needs 3: 2 are free
    sched.add(_seq(2, 9, prompt_len=BS))  # would fit, but waits behind the better one (as vLLM)
    assert _step(sched, kv) == [(0, 1)]  # sequence 0's next token takes the third block
    assert [s.seq_id for s in sched.waiting] == [1, 2] and kv.pool.num_free == 1


def _three_running(policy: str, enable_caching: bool = False) -> tuple[Scheduler, KVCacheManager, list[Sequence]]:
    """B (priority 9) running alone first, then A and C (priority 0) admitted beside it: running
    [B, A, C], each with one full prompt block and a sampled token; B already holds a second
    block. 5 blocks in the pool: 1 is free."""
    kv = KVCacheManager(BlockPool(5, enable_caching), BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, policy=policy)
    b, a, c = _seq(0, 9), _seq(1, 0), _seq(2, 0)
    sched.add(b)
    assert _step(sched, kv) == [(0, BS)]
    sched.add(a)
    sched.add(c)
    assert _step(sched, kv) == [(0, 1), (1, BS), (2, BS)]
    assert [s.seq_id for s in sched.running] == [0, 1, 2]
    assert [len(kv.block_ids(s)) for s in (b, a, c)] == [2, 1, 1] and kv.pool.num_free == 1
    return sched, kv, [b, a, c]


def test_priority_preempts_the_worst_running_sequence_even_one_scheduled_this_step():
    sched, kv, (b, a, c) = _three_running("priority")
    # B's token fits its second block; A takes the free block; C finds none. The worst running
    # sequence is B (priority 9), scheduled first in this step: it leaves the step, its 2 blocks
    # come back and C takes one of them.
    out = sched.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(1, 1), (2, 1)]
    assert out.preempted == [b] and sched.num_preemptions == 1
    assert [s.seq_id for s in sched.running] == [1, 2]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and kv.block_ids(b) == []
    assert [len(kv.block_ids(s)) for s in (a, c)] == [2, 2] and kv.pool.num_free == 1
    assert list(sched.waiting) == [b]


def test_fcfs_preempts_the_newest_running_sequence():
    sched, kv, (b, a, c) = _three_running("fcfs")
    out = sched.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 1)]
    assert out.preempted == [c] and [s.seq_id for s in sched.running] == [0, 1]
    assert [len(kv.block_ids(s)) for s in (b, a)] == [2, 2] and kv.block_ids(c) == [] and kv.pool.num_free == 1  # C's one block back


def test_a_preempted_sequence_waits_by_its_priority_not_at_the_front():
    sched, kv, (b, a, c) = _three_running("priority")
    sched.add(_seq(3, 5))  # waiting before the preemption, with a better priority than B's
    sched.schedule()
    assert [s.seq_id for s in sched.waiting] == [3, 0]


def test_a_preempted_victim_withdraws_the_block_hashes_its_step_allocation_published():
    """B's token completes its second block in the step it is preempted from: that block's KV is
    never written, so its hash must not stay findable; its first block (computed the step before)
    keeps its hash."""
    kv = KVCacheManager(BlockPool(8, True), BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, policy="priority")
    b = _seq(0, 9, prompt_len=BS + 3)
    sched.add(b)
    _step(sched, kv)  # 7 prompt tokens: the first block full and published, one sampled token
    kv.allocate(b, 1)  # its token at position 7 completes the second block: published in this step
    full = kv.block_ids(b)
    assert kv.pool.lookup(b.block_hashes[1]).block_id == full[1]
    kv.withdraw_step(b)
    assert kv.pool.lookup(b.block_hashes[1]) is None
    assert kv.pool.lookup(b.block_hashes[0]).block_id == full[0]


def test_the_victim_is_the_highest_priority_value_then_the_latest_arrival():
    running = [_seq(3, 1), _seq(1, 2), _seq(5, 2), _seq(4, 0), _seq(2, 2)]
    assert PriorityQueue.victim(running).seq_id == 5
    assert FCFSQueue.victim(running).seq_id == 2  # the newest admitted: the list's last


def test_a_priority_queue_removes_and_puts_back_by_key():
    queue = waiting_queue("priority")
    seqs = [_seq(i, p) for i, p in enumerate([3, 1, 3, 0])]
    for seq in seqs:
        queue.add(seq)
    queue.remove(seqs[1])
    assert [s.seq_id for s in queue] == [3, 0, 2] and len(queue) == 3
    assert queue.pop() is seqs[3]
    queue.prepend([seqs[3]])  # no front in a priority queue: back at its place
    assert queue.peek() is seqs[3]
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        waiting_queue("lifo")
