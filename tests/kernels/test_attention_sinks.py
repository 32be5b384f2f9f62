"""Attention sinks (gpt-oss): the twin against a per-token loop that puts each head's sink logit
in the softmax as transformers' gpt-oss does, then the C++ decode kernel and the Triton kernel
(CPU interpreter) against the twin, with and without a sliding window.

A sink of +3 against scores of order 1 takes a large share of the weight and moves head 0's
output in every row by more than 1e-2 (checked), far above the kernels' tolerances (those of
test_sliding_window_attention); a sink dropped or counted twice fails those rows.
"""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels import reference
from pagefleet.kernels.cpu import build as cpu_build, decode_attention as cpu
from pagefleet.kernels.testing import PagedBatch, make_paged_batch

SEQS = [(1, 5), (1, 13), (1, 70), (9, 40), (30, 30), (3, 21), (1, 33)]
SINKS = torch.tensor([3.0, -3.0, 0.5, -0.5])  # one per query head


def _batch(dtype=torch.float32, seqs=SEQS, block_size=4) -> PagedBatch:
    return make_paged_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size,
                            dtype=dtype, seed=11)


def _naive(batch: PagedBatch, window: int | None, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """One query token and head at a time: softmax over [scores, sink], the sink's share dropped."""
    q, kc, vc = batch.query.float(), batch.key_cache.float(), batch.value_cache.float()
    bs, group = kc.shape[1], q.shape[1] // kc.shape[2]
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    out = torch.empty_like(q)
    for b, n in enumerate(lens):
        table = batch.block_table[b].tolist()
        keys = torch.stack([kc[table[p // bs], p % bs] for p in range(n)])
        vals = torch.stack([vc[table[p // bs], p % bs] for p in range(n)])
        for row in range(starts[b], starts[b + 1]):
            pos = n - (starts[b + 1] - row)
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(q.shape[1]):
                s = (keys[lo:pos + 1, h // group] @ q[row, h]) * scale
                p = torch.cat((s, sinks[h:h + 1])).softmax(0)[:-1]
                out[row, h] = p @ vals[lo:pos + 1, h // group]
    return out


@pytest.mark.parametrize("window", [None, 13])
def test_twin_matches_the_loop(window):
    batch = _batch()
    scale = 32 ** -0.5
    got = reference.paged_attention(*batch.args(), scale, sliding_window=window, sinks=SINKS)
    torch.testing.assert_close(got, _naive(batch, window, scale, SINKS), atol=2e-6, rtol=2e-5)
    # Head 0's sink (+3) matters in every row: without it each output moves by more than 1e-2.
    plain = reference.paged_attention(*batch.args(), scale, sliding_window=window)
    assert bool(((got - plain)[:, 0].abs().amax(dim=1) > 1e-2).all())


def test_twin_in_chunks_of_query_rows_matches_the_loop(monkeypatch):
    # A 30-token prompt's scores split into chunks of 3 query rows (bounded memory on long prompts).
    monkeypatch.setattr(reference, "_SINK_CHUNK_SCORES", 3 * 4 * 30)
    batch = _batch(seqs=[(30, 30), (9, 40)])
    got = reference.paged_attention(*batch.args(), 32 ** -0.5, sliding_window=13, sinks=SINKS)
    torch.testing.assert_close(got, _naive(batch, 13, 32 ** -0.5, SINKS), atol=2e-6, rtol=2e-5)


@pytest.fixture
def _own_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "pagefleet-cache"))


@pytest.mark.parametrize("window", [None, 19])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_matches_twin(_own_cache, dtype, window):
    batch = _batch(dtype, block_size=16, seqs=[(1, 5), (1, 16), (1, 17), (1, 70), (9, 40), (1, 100), (1, 33)])
    kernel = cpu.decode_kernel(dtype, 32, 2, 2, 16)
    plan = cpu.plan_decode(batch.block_table, batch.seq_lens, batch.query_start_loc.tolist(),
                           batch.seq_lens.tolist(), kernel)
    with torch.inference_mode():
        got = cpu.paged_attention(*batch.args(), 32 ** -0.5, sliding_window=window, sinks=SINKS, plan=plan)
    want = reference.paged_attention(*(t.float() if t.is_floating_point() else t for t in batch.args()),
                                     32 ** -0.5, sliding_window=window, sinks=SINKS)
    atol = (8 if dtype == torch.float32 else 2) * torch.finfo(dtype).eps * batch.value_cache.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 13])
def test_triton_kernel_matches_twin(num_kv_splits, window):
    pytest.importorskip("triton")
    from pagefleet.kernels.paged_attention import AttentionConfig, paged_attention

    seqs = SEQS if num_kv_splits == 1 else [(1, n) for _, n in SEQS]  # split-KV runs decode-only batches
    batch = _batch(seqs=seqs)
    scale = 32 ** -0.5
    config = AttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    got = paged_attention(*batch.args(), scale, sliding_window=window, sinks=SINKS, num_kv_splits=num_kv_splits,
                          config=config)
    want = reference.paged_attention(*batch.args(), scale, sliding_window=window, sinks=SINKS)
    eps = 8 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(got, want, rtol=0, atol=eps * batch.value_cache.abs().max().item())


def test_triton_refuses_sinks_of_the_wrong_shape():
    pytest.importorskip("triton")
    from pagefleet.kernels.paged_attention import paged_attention

    batch = _batch(seqs=[(1, 5)])
    with pytest.raises(ValueError, match=r"sinks must be \[4\] on cpu, got \(2,\) on cpu"):
        paged_attention(*batch.args(), 1.0, sinks=torch.zeros(2))
