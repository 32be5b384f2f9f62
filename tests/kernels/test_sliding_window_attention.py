"""Sliding-window paged attention: the twin against a per-token loop, the Triton kernel (CPU
interpreter) and the C++ decode kernel against the twin.

Every case fills the blocks that lie wholly before a sequence's window with NaN: the KV manager
frees such blocks, so their table entries are stale and a kernel that read one would turn its
rows to NaN. Tolerances are those of the full-attention tests (test_attention_twin,
test_kernels_attention, test_cpu_decode_attention); a window off by one moves an output by about
max|V| / window, far above them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagefleet.kernels import reference
from pagefleet.kernels.cpu import build as cpu_build, decode_attention as cpu
from pagefleet.kernels.testing import PagedBatch, make_paged_batch

# (q_len, seq_len) per sequence: decode rows before, at and far past the window, prefill chunks that
# start inside and past it, and a whole prompt longer than it.
SEQS = [(1, 5), (1, 13), (1, 14), (1, 70), (9, 40), (30, 30), (3, 21), (1, 33)]
WINDOW = 13


def _batch(dtype=torch.float32, seqs=SEQS, block_size=4, **kw) -> PagedBatch:
    return make_paged_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size,
                            dtype=dtype, seed=7, **kw)


def _poisoned(batch: PagedBatch, window: int) -> PagedBatch:
    """The batch with every block wholly before each sequence's window set to NaN."""
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    bs = key_cache.shape[1]
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    poisoned = 0
    for b, n in enumerate(lens):
        first = reference.first_visible_block(n - (starts[b + 1] - starts[b]), bs, window)
        ids = batch.block_table[b, :first].long()
        key_cache[ids] = float("nan")
        value_cache[ids] = float("nan")
        poisoned += first
    assert poisoned >= 3  # the cases really have blocks outside their windows
    return dataclasses.replace(batch, key_cache=key_cache, value_cache=value_cache)


def _naive(batch: PagedBatch, window: int | None, scale: float) -> torch.Tensor:
    """One query token at a time over the unpoisoned cache: softmax over keys p - W + 1 .. p."""
    q, kc, vc = batch.query.float(), batch.key_cache.float(), batch.value_cache.float()
    bs, group = kc.shape[1], q.shape[1] // kc.shape[2]
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    out = torch.empty_like(q)
    for b, n in enumerate(lens):
        table = batch.block_table[b].tolist()
        keys = torch.stack([kc[table[p // bs], p % bs] for p in range(n)])  # [n, Hkv, D]
        vals = torch.stack([vc[table[p // bs], p % bs] for p in range(n)])
        for row in range(starts[b], starts[b + 1]):
            pos = n - (starts[b + 1] - row)
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(q.shape[1]):
                s = (keys[lo:pos + 1, h // group] @ q[row, h]) * scale
                out[row, h] = s.softmax(0) @ vals[lo:pos + 1, h // group]
    return out


def test_twin_matches_the_loop_and_reads_nothing_before_the_window():
    batch = _batch()
    scale = 32 ** -0.5
    got = reference.paged_attention(*_poisoned(batch, WINDOW).args(), scale, sliding_window=WINDOW)
    want = _naive(batch, WINDOW, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    # The window changes the rows whose context is longer than it, and only those.
    full = reference.paged_attention(*batch.args(), scale)
    torch.testing.assert_close(full, _naive(batch, None, scale), atol=2e-6, rtol=2e-5)
    differs = (got - full).abs().amax(dim=(1, 2)) > 1e-3
    positions = torch.cat([torch.arange(n - q, n) for q, n in SEQS])
    assert differs.tolist() == (positions >= WINDOW).tolist()


def test_a_window_of_one_sees_only_the_token_itself():
    batch = _batch(seqs=[(1, 9), (6, 6)])
    got = reference.paged_attention(*batch.args(), 1.0, sliding_window=1)
    bs, group = batch.key_cache.shape[1], 2
    for row, (b, pos) in enumerate([(0, 8), *((1, p) for p in range(6))]):
        block = batch.block_table[b, pos // bs]
        want = batch.value_cache[block, pos % bs].repeat_interleave(group, dim=0)
        torch.testing.assert_close(got[row], want, atol=0, rtol=0)


def test_bad_windows_are_refused():
    batch = _batch(seqs=[(1, 9)])
    with pytest.raises(ValueError, match="sliding_window must be at least 1 token, got 0"):
        reference.paged_attention(*batch.args(), 1.0, sliding_window=0)


# ---- the C++ decode kernel (decode rows in place, the rest through the twin)


@pytest.fixture
def _own_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "pagefleet-cache"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_matches_twin(_own_cache, dtype):
    batch = _batch(dtype, block_size=16, seqs=[(1, 5), (1, 16), (1, 17), (1, 70), (9, 40), (1, 100), (1, 33)])
    poisoned = _poisoned(batch, 19)
    kernel = cpu.decode_kernel(dtype, 32, 2, 2, 16)
    plan = cpu.plan_decode(batch.block_table, batch.seq_lens, batch.query_start_loc.tolist(),
                           batch.seq_lens.tolist(), kernel)
    with torch.inference_mode():
        got = cpu.paged_attention(*poisoned.args(), 32 ** -0.5, sliding_window=19, plan=plan)
    want = reference.paged_attention(*(t.float() if t.is_floating_point() else t for t in batch.args()),
                                     32 ** -0.5, sliding_window=19)
    atol = (8 if dtype == torch.float32 else 2) * torch.finfo(dtype).eps * batch.value_cache.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=atol)


# ---- the Triton kernel under the interpreter


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_twin(num_kv_splits, dtype):
    pytest.importorskip("triton")
    from pagefleet.kernels.paged_attention import AttentionConfig, paged_attention

    seqs = SEQS if num_kv_splits == 1 else [(1, n) for _, n in SEQS]  # split-KV runs decode-only batches
    batch = _batch(dtype, seqs=seqs)
    poisoned = _poisoned(batch, WINDOW)
    scale = 32 ** -0.5
    # 16-key tiles over 4-token blocks: windows start inside tiles and inside blocks.
    config = AttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    got = paged_attention(*poisoned.args(), scale, sliding_window=WINDOW, num_kv_splits=num_kv_splits,
                          config=config)
    want = reference.paged_attention(*batch.args(), scale, sliding_window=WINDOW)
    eps = {torch.float32: 8, torch.float16: 3}[dtype] * torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=0, atol=eps * batch.value_cache.abs().max().item())
