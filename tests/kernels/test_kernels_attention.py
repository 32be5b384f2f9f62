"""Triton paged attention against its twin (CPU interpreter).

Tolerance. The output is a convex combination of V rows, so errors scale with
max|V| (about 4.5 for these randn caches). Sources, per dtype eps:
* rounding the output: 1/2 ulp in the twin, 1 ulp in the kernel under the
  interpreter (bf16 stores truncate);
* P is rounded to the cache dtype before P @ V (tensor-core operands on the
  GPU; emulated under the interpreter): at most eps/2 relative per weight, so
  eps/2 * max|V| on the output; the twin's CPU SDPA rounds its own way
  (another eps/2 * max|V| at most).
That sums to 2.5 eps * max|V|: fp16 and bf16 get 3 eps * max|V|. fp32 has no
low-precision rounding; scores are D-term dot products summed in another order
and exp2 replaces exp, a few ulps each: 8 eps * max|V|. Logic errors (a wrong
block, an off-by-one causal mask) move outputs by ~max|V| / context, far above
the fp32 and fp16 bounds.
"""

import pytest
import torch

pytest.importorskip("triton")

from pagefleet.kernels import reference  # noqa: E402
from pagefleet.kernels.kv_cache_write import write_kv_cache  # noqa: E402
from pagefleet.kernels.paged_attention import AttentionConfig, paged_attention  # noqa: E402
from pagefleet.kernels.testing import make_paged_batch  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS_MULTIPLE = {torch.float32: 8, torch.float16: 3, torch.bfloat16: 3}


def _check(batch, num_kv_splits=None, rows=None, config=None):
    scale = batch.query.shape[-1] ** -0.5
    out = paged_attention(*batch.args(), scale, num_kv_splits=num_kv_splits, config=config)
    expected = reference.paged_attention(*batch.args(), scale)
    if rows is not None:
        out, expected = out[:rows], expected[:rows]
    dtype = batch.query.dtype
    atol = EPS_MULTIPLE[dtype] * torch.finfo(dtype).eps * batch.value_cache.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=0, atol=atol)


# (q_len, seq_len) per sequence: q_len 1 is decode, q_len == seq_len a fresh
# prefill, anything between a chunked-prefill continuation.
CASES = {
    "decode_gqa": dict(seqs=[(1, 37), (1, 16), (1, 1), (1, 70)], num_q_heads=4, num_kv_heads=2, head_dim=128,
                       block_size=16),
    "mixed_5q_over_1kv": dict(seqs=[(1, 37), (13, 50), (20, 20)], num_q_heads=5, num_kv_heads=1, head_dim=64,
                              block_size=16),
    "mixed_odd_block_size": dict(seqs=[(20, 20), (1, 9), (7, 45)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                                 block_size=3),
    "prefill_head_dim_80_mha": dict(seqs=[(33, 33)], num_q_heads=2, num_kv_heads=2, head_dim=80, block_size=8),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_twin(case, dtype):
    _check(make_paged_batch(**CASES[case], dtype=dtype, seed=len(case)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_tiles_cross_many_tiles_and_pages(dtype):
    # 16-key tiles over 5-token pages: a tile spans pages, a page spans tiles, and
    # the online softmax rescales across up to 5 tiles; 32 rows hold 4 tokens x 8 heads.
    batch = make_paged_batch([(1, 77), (11, 60), (16, 16)], num_q_heads=8, num_kv_heads=1, head_dim=32,
                             block_size=5, dtype=dtype, seed=8)
    _check(batch, config=AttentionConfig(block_m=32, block_n=16, num_warps=4, num_stages=2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_after_prefix_cache_hits(dtype):
    # Three requests share their first two blocks (32 tokens); two of them hit
    # the cache and only compute past it, one decodes on top of it.
    batch = make_paged_batch([(9, 41), (1, 33), (17, 49)], num_q_heads=4, num_kv_heads=1, head_dim=64,
                             block_size=16, shared_prefix_blocks=2, dtype=dtype, seed=3)
    assert torch.equal(batch.block_table[0, :2], batch.block_table[2, :2])
    _check(batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs,num_kv_splits", [
    ([(1, 70), (1, 5)], 4),   # decode: the split-KV variant's purpose
    ([(1, 37), (6, 30)], 3),  # splits also hold for multi-token rows (not a power of two either)
])
def test_split_kv_matches_twin(seqs, num_kv_splits, dtype):
    batch = make_paged_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=5)
    _check(batch, num_kv_splits=num_kv_splits)


def test_padding_query_rows_are_left_alone():
    # T = 8 query rows but only 5 scheduled (query_start_loc[-1] == 5).
    batch = make_paged_batch([(1, 20), (4, 4)], num_q_heads=2, num_kv_heads=1, head_dim=32, block_size=16,
                             dtype=torch.float32, seed=6)
    padded = torch.cat([batch.query, torch.randn(3, 2, 32)])
    batch = type(batch)(padded, *batch.args()[1:])
    _check(batch, rows=5)
    _check(batch, rows=5, num_kv_splits=2)


def test_offsets_past_2_to_the_31_elements():
    # A pool of 2^22 + 64 blocks of 512 elements (> 2^31 elements, 4 GiB of fp16
    # per cache, left untouched so the OS never backs it), with the sequence's
    # blocks at the top: block_id * stride overflows int32 unless offsets are int64.
    block_size, num_kv_heads, head_dim = 16, 1, 32
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 64
    try:
        key_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float16)
        value_cache = torch.empty_like(key_cache)
    except RuntimeError as e:  # a machine that refuses 8 GiB of lazily backed address space
        pytest.skip(f"cannot reserve the address space: {e}")
    assert num_blocks > 2**16
    gen = torch.Generator().manual_seed(7)
    context = 40
    blocks = torch.tensor([num_blocks - 1, num_blocks - 7, num_blocks - 3])
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:context]
    k = torch.randn(context, num_kv_heads, head_dim, generator=gen).half()
    v = torch.randn(context, num_kv_heads, head_dim, generator=gen).half()
    write_kv_cache(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, num_kv_heads, head_dim)[slots], k)
    assert torch.equal(value_cache.view(-1, num_kv_heads, head_dim)[slots], v)

    batch_args = (torch.randn(context, 2, head_dim, generator=gen).half(), key_cache, value_cache,
                  blocks[None].to(torch.int32), torch.tensor([0, context], dtype=torch.int32),
                  torch.tensor([context], dtype=torch.int32))
    out = paged_attention(*batch_args, head_dim**-0.5)
    expected = reference.paged_attention(*batch_args, head_dim**-0.5)
    atol = EPS_MULTIPLE[torch.float16] * torch.finfo(torch.float16).eps * v.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=0, atol=atol)


def test_paged_attention_rejects_bad_inputs():
    batch = make_paged_batch([(1, 5)], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4,
                             dtype=torch.float32)
    q, kc, vc, bt, qsl, sl = batch.args()
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.half(), kc, vc, bt, qsl, sl, 1.0)
    with pytest.raises(ValueError, match="heads"):
        paged_attention(q[:, :3], kc, vc, bt, qsl, sl, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(q, kc, vc, bt, qsl[:1], sl, 1.0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        paged_attention(q, kc, vc, bt, qsl, sl, 1.0, num_kv_splits=0)
    with pytest.raises(ValueError, match="powers of 2"):
        paged_attention(q, kc, vc, bt, qsl, sl, 1.0, config=AttentionConfig(24, 16, 4, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_twin_on_cuda(dtype):
    # The compiled kernel (no UPCAST, tensor-core dots, split-KV chosen by the heuristic) on a
    # Llama-3-8B head layout; the twin runs on the same device.
    for seqs in ([(1, 900), (1, 33), (40, 300), (64, 64)], [(1, 3000)]):
        _check(make_paged_batch(seqs, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype,
                                device="cuda", seed=9))
