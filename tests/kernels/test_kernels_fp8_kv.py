"""FP8 (e4m3) KV cache: the Triton write and attention against their twins (CPU interpreter).

The write is compared bit for bit: both multiply by 1 / scale in fp32, clamp to +-448 and round
to nearest even. Under Triton 3.9's interpreter the kernel rounds on the e4m3 grid itself before
the cast (the interpreter's own fp32 -> e4m3 cast mis-rounds); loads and e4m3 -> fp16/bf16/fp32
conversions need no help.

Attention tolerance. Both sides read the same e4m3 values, which convert exactly to the query's
dtype, so the dequantization adds no error; what remains is test_kernels_attention.py's bound
(3 eps * max|V| for fp16/bf16, 8 eps * max|V| for fp32, with V the dequantized values) plus the
twin rounding its output once more when it multiplies by v_scale (eps/2 * max|V|; the kernel
scales its fp32 accumulator): 4 eps * max|V| for fp16/bf16, 8 eps * max|V| for fp32. A wrong
scale (k_scale missing from the softmax, v_scale applied twice) moves outputs by ~max|V|.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from pagefleet.kernels import reference  # noqa: E402
from pagefleet.kernels.kv_cache_write import write_kv_cache  # noqa: E402
from pagefleet.kernels.paged_attention import paged_attention  # noqa: E402
from pagefleet.kernels.testing import make_paged_batch  # noqa: E402

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS_MULTIPLE = {torch.float32: 8, torch.float16: 4, torch.bfloat16: 4}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _write_both(k, v, shape, slots, **scales):
    got = (torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8))
    want = (torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8))
    write_kv_cache(k, v, *got, slots, **scales)
    reference.write_kv_cache(k, v, *want, slots, **scales)
    return got, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 3.0)])
def test_fp8_write_matches_twin_bit_for_bit(dtype, k_scale, v_scale):
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 200, 3, 40, 30, 7
    # Magnitudes from 1e-5 (e4m3 subnormals and zeros) to 2e3 (saturated), in both K and V.
    magnitude = torch.logspace(-5, 3.3, num_tokens)[:, None, None]
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * magnitude).to(dtype)
    v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * magnitude.flip(0)).to(dtype)
    k[0, 0, :3] = torch.tensor([-0.0, 0.0, -1e-7])  # signed zeros survive
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[5] = slots[77] = -1  # padding

    (key_cache, value_cache), (want_k, want_v) = _write_both(
        k, v, (num_blocks, block_size, num_kv_heads, head_dim), slots, k_scale=k_scale, v_scale=v_scale)

    assert torch.equal(_bits(key_cache), _bits(want_k)) and torch.equal(_bits(value_cache), _bits(want_v))
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    assert _bits(flat_k[slots[0], 0, :3]).tolist() == [0x80, 0x00, 0x80]
    assert not key_cache.float().isnan().any() and not value_cache.float().isnan().any()
    # Exactly the 198 real tokens' slots were written (no token quantizes to all +0 bytes here).
    written = (_bits(flat_k) != 0).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert written == sorted(slots[slots >= 0].tolist()) and len(written) == num_tokens - 2


def test_fp8_write_rounds_ties_to_even_and_subnormals():
    # e4m3 steps: 1/8 on [1, 2), 2^-9 below 2^-6. Halfway points go to the even neighbour;
    # a carry out of the mantissa (1.9375 -> 2.0) reaches the exponent.
    x = torch.tensor([1.0625, 1.1875, 1.9375, 3 * 2**-10, 5 * 2**-10, 2**-10, 0.0013, 125.11, -241.0])
    want = [1.0, 1.25, 2.0, 2 * 2**-9, 2 * 2**-9, 0.0, 2**-9, 128.0, -240.0]
    kv = x.view(-1, 1, 1).expand(-1, 1, 16).contiguous()
    (key_cache, _), (twin_k, _) = _write_both(kv, kv, (9, 1, 1, 16), torch.arange(9))
    assert key_cache[:, 0, 0, 0].float().tolist() == want
    assert twin_k[:, 0, 0, 0].float().tolist() == want


@pytest.mark.parametrize("scale", [1.0, 0.25, 5.0])
def test_fp8_write_saturates_instead_of_nan(scale):
    # Past 448 * scale both clamp to +-448 (the interpreter's bare cast would wrap 500 to 256).
    big = torch.tensor([449.0, 1e4, -3e5, 448.0]) * scale
    kv = big.view(-1, 1, 1).expand(-1, 2, 16).contiguous().bfloat16()
    (key_cache, value_cache), (twin_k, _) = _write_both(kv, kv, (4, 1, 2, 16), torch.arange(4),
                                                        k_scale=scale, v_scale=scale)
    for cache in (key_cache, value_cache, twin_k):
        assert cache[:, 0, 0, 0].float().tolist() == [448.0, 448.0, -448.0, 448.0]
        assert not cache.float().isnan().any()


def _fp8_batch(seqs, dtype, k_scale, v_scale, seed, **shape):
    """A batch whose caches hold the e4m3 values of randn * scale, as write_kv_cache stores them."""
    batch = make_paged_batch(seqs, dtype=dtype, seed=seed, **shape)
    key_cache = reference.quantize_kv(batch.key_cache.float() * k_scale, k_scale, FP8)
    value_cache = reference.quantize_kv(batch.value_cache.float() * v_scale, v_scale, FP8)
    return type(batch)(batch.query, key_cache, value_cache, *batch.args()[3:])


def _check(batch, k_scale, v_scale, num_kv_splits=None):
    scale = batch.query.shape[-1] ** -0.5
    out = paged_attention(*batch.args(), scale, k_scale=k_scale, v_scale=v_scale, num_kv_splits=num_kv_splits)
    expected = reference.paged_attention(*batch.args(), scale, k_scale=k_scale, v_scale=v_scale)
    dtype = batch.query.dtype
    max_v = batch.value_cache.float().abs().max().item() * v_scale
    atol = EPS_MULTIPLE[dtype] * torch.finfo(dtype).eps * max_v
    torch.testing.assert_close(out, expected, rtol=0, atol=atol)


CASES = {
    "mixed_gqa": dict(seqs=[(1, 37), (13, 50), (20, 20), (1, 1)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                      block_size=16),
    "odd_block_size_5q_over_1kv": dict(seqs=[(20, 20), (1, 9), (7, 45)], num_q_heads=5, num_kv_heads=1,
                                       head_dim=40, block_size=3),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.3, 2.7)])
def test_fp8_attention_matches_twin(case, dtype, k_scale, v_scale):
    _check(_fp8_batch(**CASES[case], dtype=dtype, k_scale=k_scale, v_scale=v_scale, seed=len(case)),
           k_scale, v_scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_split_kv_decode_matches_twin(dtype):
    # The split path scales each partial by v_scale before the merge.
    batch = _fp8_batch([(1, 70), (1, 5), (1, 33)], dtype=dtype, k_scale=0.6, v_scale=1.9, seed=5, num_q_heads=4,
                       num_kv_heads=2, head_dim=64, block_size=16)
    _check(batch, 0.6, 1.9, num_kv_splits=4)


def test_fp8_twin_is_attention_over_dequantized_caches():
    # Power-of-two scales make folding them into the softmax scale and the output exact, so the
    # twin's fp8 path must equal its own fp32 attention over K * k_scale and V * v_scale bit for bit.
    batch = _fp8_batch([(1, 37), (13, 50), (20, 20)], dtype=torch.float32, k_scale=0.5, v_scale=4.0, seed=2,
                       num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    scale = 32 ** -0.5
    got = reference.paged_attention(*batch.args(), scale, k_scale=0.5, v_scale=4.0)
    want = reference.paged_attention(batch.query, batch.key_cache.float() * 0.5, batch.value_cache.float() * 4.0,
                                     *batch.args()[3:], scale)
    assert torch.equal(got, want)
    # And a wrong k_scale is visible: the kernel contract is not vacuous.
    wrong = reference.paged_attention(*batch.args(), scale, k_scale=1.0, v_scale=4.0)
    assert (wrong - want).abs().max().item() > 0.1


def test_fp8_rejects_bad_scales_and_dtypes():
    k = torch.randn(2, 1, 32).bfloat16()
    cache = torch.zeros(4, 2, 1, 32, dtype=FP8)
    slots = torch.tensor([0, 1])
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="k_scale must be a finite positive float"):
            write_kv_cache(k, k, cache, cache.clone(), slots, k_scale=bad)
        with pytest.raises(ValueError, match="v_scale must be a finite positive float"):
            paged_attention(k, cache, cache.clone(), torch.zeros(1, 1, dtype=torch.int32),
                            torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 1.0,
                            v_scale=bad)
    with pytest.raises(ValueError, match="dtypes differ"):
        write_kv_cache(k, k, cache, torch.zeros(4, 2, 1, 32, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        paged_attention(k, cache.half(), cache.half(), torch.zeros(1, 1, dtype=torch.int32),
                        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fp8_kernels_match_twins_on_cuda(dtype):
    # The compiled kernels: the hardware e4m3 cast (no grid rounding) and fp8 tile loads.
    gen = torch.Generator().manual_seed(4)
    k = (torch.randn(500, 8, 128, generator=gen) * torch.logspace(-5, 3.3, 500)[:, None, None]).to("cuda", dtype)
    slots = torch.randperm(64 * 16, generator=gen)[:500].cuda()
    shape = (64, 16, 8, 128)
    got = (torch.zeros(shape, dtype=FP8, device="cuda"), torch.zeros(shape, dtype=FP8, device="cuda"))
    want = (torch.zeros(shape, dtype=FP8, device="cuda"), torch.zeros(shape, dtype=FP8, device="cuda"))
    write_kv_cache(k, k, *got, slots, k_scale=0.37, v_scale=3.0)
    reference.write_kv_cache(k, k, *want, slots, k_scale=0.37, v_scale=3.0)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(_bits(got[1]), _bits(want[1]))
    for seqs in ([(1, 900), (1, 33), (40, 300), (64, 64)], [(1, 3000)]):
        batch = _fp8_batch(seqs, dtype=dtype, k_scale=0.5, v_scale=1.5, seed=9, num_q_heads=32, num_kv_heads=8,
                           head_dim=128, block_size=16)
        batch = type(batch)(*(t.cuda() for t in batch.args()))
        _check(batch, 0.5, 1.5)
