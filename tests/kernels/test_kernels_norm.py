"""Triton RMSNorm and fused residual-add + RMSNorm against their twins (CPU interpreter).

Tolerances, relative, in units of the dtype's eps (eps * |x| >= 1 ulp of x):
* bf16: the kernel rounds twice (normalised row to bf16, then weight * row) and
  the interpreter truncates both times, each < 1 eps relative, where the twin
  rounds to nearest (<= 1/2 eps each): < 3 eps apart. The fused kernel also
  feeds its truncated residual (< 1 eps off) into the norm: < 4 eps.
* fp16: both sides round to nearest twice (<= 1 eps each side): 2 eps.
* fp32: no low-precision rounding; sum order and rsqrt differ by a few ulps: 8.
* The new residual is `x + residual` rounded once: exact in fp32/fp16 (same
  RTNE rounding of the same exact fp32 sum), < 1 eps relative in bf16
  (interpreter truncation against rounding).
"""

import pytest
import torch

pytest.importorskip("triton")

from pagefleet.kernels import reference  # noqa: E402
from pagefleet.kernels.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS_MULTIPLE = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 3}
FUSED_EPS_MULTIPLE = {**EPS_MULTIPLE, torch.bfloat16: 4}


def _tol(dtype, table=EPS_MULTIPLE):
    eps = torch.finfo(dtype).eps
    return dict(rtol=table[dtype] * eps, atol=table[dtype] * eps)


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 123), (2, 3, 64), (1, 1)])
def test_rms_norm_matches_twin(dtype, shape):
    x, _, weight = _inputs(shape, dtype)
    out = rms_norm(x, weight, 1e-5)
    expected = reference.rms_norm(x, weight, 1e-5)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_twin_and_leaves_inputs(dtype):
    x, residual, weight = _inputs((9, 123), dtype, seed=1)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    expected, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, expected, **_tol(dtype, FUSED_EPS_MULTIPLE))
    if dtype == torch.bfloat16:
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(new_residual, expected_residual, rtol=eps, atol=eps)
    else:
        assert torch.equal(new_residual, expected_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_on_strided_rows_and_qk_norm_shape():
    # Qwen3's q/k norm: RMSNorm over head_dim of a [T, H, D] view cut from the fused QKV output.
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 7 * 32, generator=gen)
    q = qkv[:, : 5 * 32].view(5, 5, 32)
    weight = torch.rand(32, generator=gen) + 0.5
    torch.testing.assert_close(rms_norm(q, weight, 1e-6), reference.rms_norm(q, weight, 1e-6),
                               **_tol(torch.float32))


def test_rms_norm_promotes_like_twin():
    x, _, _ = _inputs((3, 40), torch.bfloat16)
    weight = torch.rand(40) + 0.5  # fp32 weight over bf16 activations
    out = rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-5), **_tol(torch.bfloat16))


def test_rms_norm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(3, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(torch.randn(3, 8), torch.randn(3, 9), torch.ones(8), 1e-6)
