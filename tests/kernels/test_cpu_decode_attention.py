"""The CPU decode attention kernel (C++, KV blocks read in place) against the twin,
reference.paged_attention.

fp32 tolerance: the output is a convex combination of V rows; the kernel sums the scores block
by block with an online softmax (vectorised, reassociated) where the twin gathers whole contexts
into SDPA, so the two differ by a few ulps per term: 8 eps * max|V|. A wrong block or an
off-by-one length moves outputs by about max|V| / context, hundreds of times more. bf16 and
fp16 are compared with the twin run in fp32 on the same (rounded) inputs: the kernel computes
in fp32 and rounds once at the end, so one rounding of the output (2 eps of the type) bounds it.
"""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels import reference
from pagefleet.kernels.cpu import build as cpu_build, decode_attention as cpu
from pagefleet.kernels.testing import forget_loaded_cpu_kernels, make_paged_batch

BLOCK_SIZE = 16
CASES = {
    # (q_len, seq_len) per row, and the pool's block count
    "decode of spread lengths": ([(1, 3), (1, 40), (1, 17), (1, 90), (1, 16), (1, 1), (1, 33)], 2048),
    "one decode row": ([(1, 47)], 100),
    "decode among prompts and prefill chunks": (
        [(1, 33), (12, 30), (1, 8), (9, 9), (35, 80), (1, 64), (2, 2)], 513),
}


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path_factory):
    # One kernel cache for this module's tests, not the user's.
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "pagefleet-cache"))


def _batch(seqs, pool_blocks, dtype=torch.float32, **kw):
    used = sum(-(-n // BLOCK_SIZE) for _, n in seqs) - kw.get("shared_prefix_blocks", 0) * (len(seqs) - 1)
    return make_paged_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE,
                            dtype=dtype, extra_blocks=pool_blocks - used, **kw)


def _check(batch, query=None):
    query = batch.query if query is None else query
    args = (query, *batch.args()[1:])
    scale = batch.query.shape[-1] ** -0.5
    num_heads, head_dim = batch.query.shape[1:]
    block_size, num_kv_heads = batch.key_cache.shape[1:3]
    kernel = cpu.decode_kernel(batch.query.dtype, head_dim, num_heads // num_kv_heads, num_kv_heads, block_size)
    plan = cpu.plan_decode(batch.block_table, batch.seq_lens, batch.query_start_loc.tolist(), batch.seq_lens.tolist(),
                           kernel)
    with torch.inference_mode():  # as the engine calls it
        got = cpu.paged_attention(*args, scale, plan=plan)
    want = reference.paged_attention(*(t.float() if t.is_floating_point() else t for t in args), scale)
    dtype = batch.query.dtype
    bound = batch.value_cache.abs().max().item()
    atol = (8 if dtype == torch.float32 else 2) * torch.finfo(dtype).eps * bound
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=0, atol=atol)
    return plan


@pytest.mark.parametrize("case", list(CASES))
def test_matches_twin(case):
    _check(_batch(*CASES[case], seed=len(case)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype):
    _check(_batch(*CASES["decode among prompts and prefill chunks"], dtype=dtype, seed=7))


def test_a_strided_query_as_the_engine_passes_it():
    # The engine's query is a view into the fused QKV projection: rows further apart than Hq x D.
    batch = _batch(*CASES["decode of spread lengths"], seed=8)
    fused = torch.randn(batch.query.shape[0], 3 * batch.query.shape[1], batch.query.shape[2])
    query = fused[:, :batch.query.shape[1]]
    assert not query.is_contiguous()
    _check(batch, query)


def test_plan_splits_decode_rows_from_the_rest():
    plan = _check(_batch(*CASES["decode among prompts and prefill chunks"], seed=1))
    # Decode rows are sequences 0, 2, 5 at tokens 0, 13, 58; the twin takes 1, 3, 4, 6.
    assert plan.rows.tolist() == [0, 13, 58]
    assert plan.multi == [1, 3, 4, 6]
    assert plan.seq_lens.tolist() == [33, 8, 64]
    all_decode = _check(_batch(*CASES["decode of spread lengths"], seed=2))
    assert all_decode.rows is None and all_decode.multi == []


def test_no_decode_rows_is_no_plan():
    batch = _batch([(5, 5), (3, 20)], 64, seed=3)
    assert cpu.plan_decode(batch.block_table, batch.seq_lens, [0, 5, 8], [5, 20], kernel=None) is None


def test_shared_prefix_blocks_and_wide_tables():
    # Table entries pointing at the same physical blocks, and padding columns past every row's end.
    seqs = [(1, 70), (1, 75), (1, 66), (1, 82)]
    _check(_batch(seqs, 777, shared_prefix_blocks=4, table_width=12, seed=5))


def test_one_build_per_model_shape_kept_across_processes(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    forget_loaded_cpu_kernels()
    before = cpu_build.builds
    _check(_batch([(1, 20), (1, 5)], 300, seed=6))
    assert cpu_build.builds == before + 1
    assert len(list((tmp_path / "cpu_kernels").glob("decode_attention_*.so"))) == 1
    # Other pools, row counts and dtypes: the same library.
    for seed, (seqs, pool_blocks) in enumerate([([(1, 47)], 64), ([(1, 9)] * 5, 1500), ([(1, 3), (4, 4)], 3000)]):
        _check(_batch(seqs, pool_blocks, dtype=(torch.float32, torch.bfloat16, torch.float16)[seed], seed=seed))
    assert cpu_build.builds == before + 1
    # A new process (no library loaded) loads the file instead of compiling.
    forget_loaded_cpu_kernels()
    _check(_batch([(1, 20)], 30, seed=9))
    assert cpu_build.builds == before + 1
    # Another block size is another shape.
    _check(make_paged_batch([(1, 20)], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                            dtype=torch.float32))
    assert cpu_build.builds == before + 2
    forget_loaded_cpu_kernels()  # later tests load from their own cache directory


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(cpu_build.COMPILER_ENV, str(tmp_path / "no-such-c++"))
    cpu_build._compiler.cache_clear()
    forget_loaded_cpu_kernels()
    try:
        with pytest.raises(RuntimeError, match="need a C\\+\\+ compiler .*enforce_eager=True"):
            cpu.decode_kernel(torch.float32, 32, 2, 2, 16)
    finally:
        cpu_build._compiler.cache_clear()
        forget_loaded_cpu_kernels()
