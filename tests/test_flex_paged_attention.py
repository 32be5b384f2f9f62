"""Paged FlexAttention (KV blocks read in place) against the twin, reference.paged_attention.

Every case uses the pool shape of the tiny test checkpoints at 32 MiB (2048 blocks of 16,
4 query / 2 KV heads of 32), so the kernels compiled here serve the compiled engine tests
too: one for decode rows, one per continuation bucket.

fp32 tolerance: the output is a convex combination of V rows; flex sums the
scores block by block with an online softmax where the twin gathers whole
contexts into SDPA, so the two differ by a few ulps per term: 8 eps * max|V|
as for the Triton kernel. A wrong block or an off-by-one causal mask moves
outputs by about max|V| / context, hundreds of times more.
"""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels import reference
from pagefleet.kernels.flex_paged_attention import PREFILL_Q_BLOCK, build_plan, flex_paged_attention, query_bucket, query_buckets
from pagefleet.kernels.testing import make_paged_batch

BLOCK_SIZE, POOL_BLOCKS = 16, 2048
MAX_Q_LEN = 2048  # the engine's default max_num_batched_tokens
CASES = {
    # (q_len, seq_len) per row
    "decode of spread lengths": [(1, 3), (1, 40), (1, 17), (1, 90), (1, 16), (1, 1)],
    "fresh prefills": [(5, 5), (37, 37), (16, 16), (70, 70)],
    "decode, fresh prompts and prefill chunks": [(1, 33), (12, 30), (1, 8), (9, 9), (PREFILL_Q_BLOCK + 3, 80),
                                                 (1, 64), (2, 2)],
    "one long chunk after a long context": [(PREFILL_Q_BLOCK + 28, 150)],
}


def _batch(seqs, **kw):
    used = sum(-(-n // BLOCK_SIZE) for _, n in seqs) - kw.get("shared_prefix_blocks", 0) * (len(seqs) - 1)
    return make_paged_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE,
                            dtype=torch.float32, extra_blocks=POOL_BLOCKS - used, **kw)


def _step_kv(batch):
    """This step's keys and values, [T, Hkv, D] each, read back from the slots they were written to."""
    keys, values = [], []
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        for pos in range(seq_len - (starts[b + 1] - starts[b]), seq_len):
            block = batch.block_table[b, pos // BLOCK_SIZE]
            keys.append(batch.key_cache[block, pos % BLOCK_SIZE])
            values.append(batch.value_cache[block, pos % BLOCK_SIZE])
    return torch.stack(keys), torch.stack(values)


def _check(batch):
    assert batch.key_cache.shape[0] == POOL_BLOCKS
    scale = batch.query.shape[-1] ** -0.5
    # block_pos starts as garbage: the plan must fill in every block the tables use.
    block_pos = torch.full((POOL_BLOCKS,), 7, dtype=torch.int32)
    plan = build_plan(batch.block_table, batch.query_start_loc.tolist(), batch.seq_lens.tolist(), BLOCK_SIZE,
                      block_pos, MAX_Q_LEN)
    got = flex_paged_attention(batch.query, *_step_kv(batch), batch.key_cache, batch.value_cache, plan, scale)
    want = reference.paged_attention(*batch.args(), scale)
    atol = 8 * torch.finfo(torch.float32).eps * batch.value_cache.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    return plan


@pytest.mark.parametrize("case", list(CASES))
def test_matches_twin(case):
    _check(_batch(CASES[case], seed=len(case)))


def test_rows_are_split_by_kind():
    plan = _check(_batch(CASES["decode, fresh prompts and prefill chunks"], seed=1))
    # Fresh prompts attend over their own K/V: (9, 9) at tokens 14..22, (2, 2) at 59..60.
    assert plan.fresh == [(14, 23), (59, 61)]
    assert [(p.q_len, p.num_rows) for p in plan.parts] == [(1, 3), (16, 1), (64, 1)]
    assert query_buckets(2048) == [1, 16, 64, 256, 1024, 2048]
    assert query_buckets(7) == [1, 7]
    assert [query_bucket(n, 2048) for n in (1, 2, 16, 17, 64, 65, 2000)] == [1, 16, 16, 64, 64, 256, 2048]


def test_shared_prefix_blocks_and_wide_tables():
    # Table entries pointing at the same physical blocks, and padding columns past every row's end.
    seqs = [(1, 70), (7, 75), (1, 66), (14, 82)]
    _check(_batch(seqs, shared_prefix_blocks=4, table_width=12, seed=5))
