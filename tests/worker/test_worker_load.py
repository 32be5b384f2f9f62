"""What a worker's KV events say of its load: the blocks its sequences will still take, and when
its running sequences end and what each end gives back (no model)."""

from __future__ import annotations

from pagefleet.worker.core.block_pool import KVBlock
from pagefleet.worker.core.kv_events import (
    KVEventBatch,
    KVLoad,
    Release,
    merge_batches,
    pack_releases,
    unpack_releases,
)
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.core.worker_load import shared_blocks, steps_left, worker_load
from pagefleet.worker.sampling_params import SamplingParams

BLOCK = 16
MAX_LEN = 256
BUDGET = 16  # max_num_batched_tokens: a 40-token prompt is 3 chunks


def seq(seq_id: int, prompt_len: int, max_tokens: int | None, computed: int = 0, outputs: int = 0) -> Sequence:
    s = Sequence(seq_id, f"r{seq_id}", 0, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
    for t in range(outputs):
        s.append_token(t)
    s.num_computed_tokens = computed
    return s


def table(*ref_cnts: int) -> list[KVBlock]:
    blocks = [KVBlock(i) for i in range(len(ref_cnts))]
    for block, ref in zip(blocks, ref_cnts):
        block.ref_cnt = ref
    return blocks


def test_steps_left_count_tokens_to_generate_and_the_prompt_chunks_still_to_compute():
    decoding = seq(0, 40, 10, computed=40, outputs=1)  # prefilled, 1 of 10 tokens out
    assert steps_left(decoding, MAX_LEN, BUDGET) == 9
    fresh = seq(1, 40, 10)  # 3 chunks; the last one samples the first token
    assert steps_left(fresh, MAX_LEN, BUDGET) == 10 + 2
    capped = seq(2, 250, 100, computed=250, outputs=1)  # max_model_len ends it first: 256 - 251
    assert steps_left(capped, MAX_LEN, BUDGET) == 5
    unbounded = seq(3, 40, None, computed=40, outputs=1)  # no max_tokens: to max_model_len
    assert steps_left(unbounded, MAX_LEN, BUDGET) == 256 - 41


def test_shared_blocks_are_the_leading_ones_another_sequence_holds():
    assert [shared_blocks(table(*refs)) for refs in ((), (1, 1), (2, 1, 1), (3, 2, 2), (2, 2, 1))] == [0, 0, 1, 3, 2]


def test_worker_load_groups_running_sequences_by_steps_left_with_the_blocks_their_end_frees():
    a = seq(0, 40, 10, computed=40, outputs=1)  # ends in 9 steps at 50 tokens = 4 blocks, 3 held
    b = seq(1, 40, 10)  # ends in 12; its 2-block cached prefix is shared with c
    c = seq(2, 56, 3, computed=56, outputs=1)  # ends in 2 at 59 tokens = 4 blocks, the first 2 shared
    d = seq(3, 24, 17, computed=24, outputs=10)  # ends in 7 at 41 tokens = 3 blocks, all held
    e = seq(4, 40, 10)  # waiting: reserves its 4 blocks, frees none (it has not started)
    tables = {0: table(1, 1, 1), 1: table(2, 2), 2: table(2, 2, 1, 1), 3: table(1, 1, 1)}
    load = worker_load([a, b, c, d], [e], tables, BLOCK, MAX_LEN, BUDGET, step_time_s=0.03)
    assert unpack_releases(load.releases) == [Release(2, 1, 4 - 2), Release(7, 1, 3), Release(9, 1, 4),
                                              Release(12, 1, 4 - 2)]
    assert load == KVLoad(num_running=4, num_waiting=1, num_reserved_blocks=1 + 2 + 0 + 0 + 4,
                          releases=load.releases, step_time_s=0.03)
    same = worker_load([a, seq(5, 40, 10, computed=40, outputs=1)], [], {0: table(1, 1, 1)}, BLOCK, MAX_LEN, BUDGET,
                       step_time_s=0.03)
    assert unpack_releases(same.releases) == [Release(9, 2, 8)]  # one entry per number of steps


def test_releases_pack_as_uint32_triples_and_a_merged_batch_keeps_the_last_ones():
    packed = pack_releases([Release(3, 1, 2), Release(70_000, 64, 5_000)])
    assert len(packed) == 2 * 12 and unpack_releases(packed) == [Release(3, 1, 2), Release(70_000, 64, 5_000)]
    first = KVEventBatch("w0", 0, 0, False, releases=pack_releases([Release(5, 1, 1)]), step_time_s=0.02)
    last = KVEventBatch("w0", 1, 1, False, releases=pack_releases([Release(4, 1, 1)]), step_time_s=0.03)
    merged = merge_batches([first, last])
    assert (unpack_releases(merged.releases), merged.step_time_s) == ([Release(4, 1, 1)], 0.03)


def test_a_windowed_model_reserves_no_more_than_a_sequence_ever_holds():
    # Every layer sliding: a sequence holds at most 5 blocks (its window, a step and one more),
    # whatever its length, so a 40-token prompt growing to 200 reserves 5, and one holding 2 of them
    # (its table less the blocks given back) 3 more.
    running = seq(0, 40, 160, computed=40, outputs=1)
    waiting = seq(1, 40, 160)
    load = worker_load([running], [waiting], {0: table(1, 1)}, BLOCK, MAX_LEN, BUDGET, 0.01, max_blocks_held=5)
    assert load.num_reserved_blocks == 3 + 5
    assert unpack_releases(load.releases) == [Release(159, 1, 5)]
    unwindowed = worker_load([running], [waiting], {0: table(1, 1)}, BLOCK, MAX_LEN, BUDGET, 0.01)
    assert unwindowed.num_reserved_blocks == (13 - 2) + 13
