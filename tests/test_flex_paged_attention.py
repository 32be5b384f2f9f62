"""Paged FlexAttention for decode rows (KV blocks read in place) against the twin,
reference.paged_attention.

The cases use pools of different sizes (as engines with different KV budgets do) and different
row counts: one compiled kernel serves them all, which the last test counts.

fp32 tolerance: the output is a convex combination of V rows; flex sums the scores block
by block with an online softmax where the twin gathers whole contexts into SDPA, so the
two differ by a few ulps per term: 8 eps * max|V| as for the Triton kernel. A wrong block
or an off-by-one length mask moves outputs by about max|V| / context, hundreds of times
more.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from pagefleet.kernels import flex_paged_attention as flex
from pagefleet.kernels import reference
from pagefleet.kernels.testing import make_paged_batch

BLOCK_SIZE = 16
CASES = {
    # (q_len, seq_len) per row, and the pool's block count
    "decode of spread lengths": ([(1, 3), (1, 40), (1, 17), (1, 90), (1, 16), (1, 1), (1, 33)], 2048),
    "one decode row": ([(1, 47)], 100),
    "decode among prompts and prefill chunks": (
        [(1, 33), (12, 30), (1, 8), (9, 9), (35, 80), (1, 64), (2, 2)], 513),
}


def _batch(seqs, pool_blocks, **kw):
    used = sum(-(-n // BLOCK_SIZE) for _, n in seqs) - kw.get("shared_prefix_blocks", 0) * (len(seqs) - 1)
    # Inference tensors, as the engine's are: a plain tensor would be a guard of its own.
    with torch.inference_mode():
        return make_paged_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE,
                                dtype=torch.float32, extra_blocks=pool_blocks - used, **kw)


def _check(batch):
    pool_blocks = batch.key_cache.shape[0]
    scale = batch.query.shape[-1] ** -0.5
    plan = flex.DecodePlanner(pool_blocks, BLOCK_SIZE).plan(batch.block_table, batch.query_start_loc.tolist(),
                                                            batch.seq_lens.tolist())
    with torch.inference_mode():  # as the engine calls it
        got = flex.paged_attention(*batch.args(), scale, plan)
    want = reference.paged_attention(*batch.args(), scale)
    atol = 8 * torch.finfo(torch.float32).eps * batch.value_cache.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    return plan


@pytest.mark.parametrize("case", list(CASES))
def test_matches_twin(case):
    _check(_batch(*CASES[case], seed=len(case)))


def test_plan_splits_decode_rows_from_the_rest():
    plan = _check(_batch(*CASES["decode among prompts and prefill chunks"], seed=1))
    # Decode rows are sequences 0, 2, 5 at tokens 0, 13, 58; the twin takes 1, 3, 4, 6.
    assert plan.rows.tolist() == [0, 13, 58]
    assert plan.multi == [1, 3, 4, 6]
    assert not plan.all_rows
    # Lengths 33, 8, 64: 2, 0, 3 full blocks before the last, which holds 1, 8, 16 slots.
    assert plan.full_kv_num.flatten().tolist() == [2, 0, 3]
    assert plan.last_len.tolist() == [1, 8, 16]
    all_decode = _check(_batch(*CASES["decode of spread lengths"], seed=2))
    assert all_decode.all_rows and all_decode.multi == []


def test_no_decode_rows_is_no_plan():
    batch = _batch([(5, 5), (3, 20)], 64, seed=3)
    assert flex.DecodePlanner(64, BLOCK_SIZE).plan(batch.block_table, [0, 5, 8], [5, 20]) is None


def test_shared_prefix_blocks_and_wide_tables():
    # Table entries pointing at the same physical blocks, and padding columns past every row's end.
    seqs = [(1, 70), (1, 75), (1, 66), (1, 82)]
    _check(_batch(seqs, 777, shared_prefix_blocks=4, table_width=12, seed=5))


def test_one_compile_serves_every_pool_and_row_count():
    _check(_batch([(1, 20), (1, 5)], 300, seed=6))  # compiled here, or by an earlier test
    graphs = counters["stats"]["unique_graphs"]
    for seed, (seqs, pool_blocks) in enumerate([([(1, 47)], 64), ([(1, 9)] * 5, 1500), ([(1, 3), (4, 4)], 3000)]):
        _check(_batch(seqs, pool_blocks, seed=seed))
    assert counters["stats"]["unique_graphs"] == graphs
