"""The step buffers' block table written by differences: whatever order sequences come, go,
grow and are reallocated in, the rows a step's kernels read equal its tables, as a buffer
written from scratch holds them."""

from __future__ import annotations

import random

import pytest
import torch

from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.model_executor.model_runner import StepInput
from pagefleet.worker.model_executor.step_buffers import StepBuffers
from pagefleet.worker.sampling_params import SamplingParams

MAX_SEQS, MAX_BLOCKS = 12, 9


def _decode_step(tables: list[list[int]]) -> StepInput:
    b = len(tables)
    return StepInput(list(range(b)), [0] * b, list(range(b)), tables, list(range(b + 1)),
                     [len(t) for t in tables], list(range(b)))


def _read_rows(buffers: StepBuffers, tables: list[list[int]], rows: int) -> list[list[int]]:
    table = buffers.block_table(rows)
    return [table[i, :len(t)].tolist() for i, t in enumerate(tables)]


@pytest.mark.parametrize("seed", range(30))
def test_rows_written_by_differences_equal_the_tables_across_random_steps(seed):
    rng = random.Random(seed)
    buffers = StepBuffers(max_tokens=MAX_SEQS, max_seqs=MAX_SEQS, max_blocks=MAX_BLOCKS, device=torch.device("cpu"))
    next_block = iter(range(10**6))
    live: list[list[int]] = []
    moved = copied_rows = 0
    for _ in range(200):
        # Sequences end anywhere in the order (the rows after them move up), a few are freed
        # and allocated again (a new list), the rest may gain a block; new ones join at the end.
        live = [t for t in live if rng.random() > 0.15]
        for k, t in enumerate(live):
            if rng.random() < 0.05:
                live[k] = [next(next_block) for _ in range(rng.randint(1, MAX_BLOCKS))]
            elif len(t) < MAX_BLOCKS and rng.random() < 0.3:
                t.append(next(next_block))
        while len(live) < MAX_SEQS and rng.random() < 0.4:
            live.append([next(next_block) for _ in range(rng.randint(1, 3))])
        if rng.random() < 0.05:
            rng.shuffle(live)
        if not live:
            continue
        before = {id(x): i for i, x in enumerate(buffers._row_lists) if x is not None}
        moved += sum(1 for i, t in enumerate(live) if before.get(id(t), i) > i)
        step = _decode_step(live)
        if rng.random() < 0.5:
            rows = buffers.fill(step, pad_to=rng.randint(len(live), MAX_SEQS))
        else:
            rows = buffers.fill(step, pad_tokens=(MAX_SEQS, MAX_SEQS))
        assert _read_rows(buffers, live, rows) == live
        fresh = StepBuffers(max_tokens=MAX_SEQS, max_seqs=MAX_SEQS, max_blocks=MAX_BLOCKS, device=torch.device("cpu"))
        fresh.fill(step, pad_to=rows)
        assert _read_rows(buffers, live, rows) == _read_rows(fresh, live, rows)
        # Padding rows read block 0, as a fresh buffer's do.
        assert buffers.block_table(rows)[len(live):, 0].tolist() == [0] * (rows - len(live))
        copied_rows += len(live)
    assert moved > 0 and copied_rows > 0  # the walk moved rows up, not only appended


def test_a_row_holding_the_same_list_gets_only_its_new_blocks():
    buffers = StepBuffers(max_tokens=4, max_seqs=4, max_blocks=4, device=torch.device("cpu"))
    a, b = [3], [7, 8]
    buffers.fill(_decode_step([a, b]))
    # A stray value past a row's written blocks stays: only the appended column is written.
    table = buffers.block_table(2)
    table[0, 2] = 99
    a.append(4)
    buffers.fill(_decode_step([a, b]))
    assert table[0].tolist()[:3] == [3, 4, 99]
    # b moves up into a's row when a ends: copied from its old row, then its new block.
    b.append(9)
    buffers.fill(_decode_step([b]))
    assert buffers.block_table(1)[0, :3].tolist() == [7, 8, 9]


def test_the_kv_manager_keeps_one_growing_list_per_allocation():
    kv = KVCacheManager(BlockPool(16), block_size=4)
    seq = Sequence(1, "r", 0, list(range(6)), SamplingParams(max_tokens=8))
    assert kv.allocate(seq, 6)
    ids = kv.block_ids(seq)
    assert ids == [b.block_id for b in kv.block_tables[1]] and len(ids) == 2
    seq.num_computed_tokens = 6
    assert kv.allocate(seq, 3)  # 9 tokens: a third block, appended to the same list
    assert kv.block_ids(seq) is ids and ids == [b.block_id for b in kv.block_tables[1]] and len(ids) == 3
    kv.free(seq)
    assert kv.block_ids(seq) == []
    seq.num_computed_tokens = 0
    assert kv.allocate(seq, 6)
    again = kv.block_ids(seq)
    assert again is not ids and again == [b.block_id for b in kv.block_tables[1]]
