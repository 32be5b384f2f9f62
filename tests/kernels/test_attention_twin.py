"""The CPU twin of paged attention against a per-token loop with no batching tricks."""

from __future__ import annotations

import math

import torch

from pagefleet.kernels.reference import _length_groups, paged_attention


def naive(query, key_cache, value_cache, tables, q_lens, ctx_lens, scale):
    # One query token at a time: softmax over its visible keys, GQA by head index.
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // hkv
    out, row = torch.empty_like(query), 0
    for table, q_len, ctx in zip(tables, q_lens, ctx_lens):
        keys = torch.stack([key_cache[table[p // bs], p % bs] for p in range(ctx)])  # [L, Hkv, D]
        vals = torch.stack([value_cache[table[p // bs], p % bs] for p in range(ctx)])
        for i in range(q_len):
            visible = ctx - q_len + i + 1
            for h in range(query.shape[1]):
                s = (keys[:visible, h // group] @ query[row, h]) * scale
                out[row, h] = s.softmax(0) @ vals[:visible, h // group]
            row += 1
    return out


def test_decode_rows_of_spread_lengths_and_prefill_chunks_match_the_loop():
    gen = torch.Generator().manual_seed(3)
    bs, hq, hkv, d = 4, 6, 2, 8
    ctx_lens = [3, 40, 7, 90, 41, 5, 88, 12, 30, 9]  # decode rows spread widely...
    q_lens = [1, 1, 1, 1, 1, 1, 1, 1, 12, 9]          # ...then a prefill chunk and a fresh prefill
    ctx_lens[-1] = 9
    # The decode rows really are split into several length groups.
    decode = sorted(range(8), key=lambda b: ctx_lens[b])
    assert len(_length_groups(decode, ctx_lens)) >= 3
    nblocks = [math.ceil(c / bs) for c in ctx_lens]
    perm = torch.randperm(sum(nblocks) + 5, generator=gen).tolist()
    tables, at = [], 0
    for n in nblocks:
        tables.append(perm[at:at + n])
        at += n
    num_blocks = len(perm)
    key_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    value_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    query = torch.randn(sum(q_lens), hq, d, generator=gen)
    table = torch.zeros(len(tables), max(nblocks), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    got = paged_attention(query, key_cache, value_cache, table, starts, torch.tensor(ctx_lens, dtype=torch.int32),
                          d ** -0.5)
    want = naive(query, key_cache, value_cache, tables, q_lens, ctx_lens, d ** -0.5)
    # fp32, a few hundred terms per softmax: a few ulps of |v| ~ 1
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
