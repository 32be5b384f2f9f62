"""Triton SiLU-and-mul against its twin (CPU interpreter).

Tolerance, in units of the dtype's eps: both round SiLU(gate) to the activation
dtype and then round the product; fp32 exp implementations may differ by an ulp,
which can move the first rounding across a boundary (1 ulp) and the
interpreter truncates bf16 stores (1 more ulp): 2 ulps relative for fp16/bf16,
a few ulps for fp32.
"""

import pytest
import torch

pytest.importorskip("triton")

from pagefleet.kernels import reference  # noqa: E402
from pagefleet.kernels.activation import silu_and_mul  # noqa: E402

ULPS = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2 * 123), (2, 3, 2 * 1100), (1, 2)])
def test_silu_and_mul_matches_twin(dtype, shape):
    x = (4 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)
    out = silu_and_mul(x)
    expected = reference.silu_and_mul(x)
    assert out.shape == expected.shape == (*shape[:-1], shape[-1] // 2)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, expected, rtol=ULPS[dtype] * eps, atol=ULPS[dtype] * eps)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, in the interpreter
def test_silu_and_mul_saturates_without_nan():
    # exp(-gate) overflows for very negative gates: SiLU must go to -0, not NaN.
    x = torch.tensor([[-1000.0, -88.0, 0.0, 90.0, 2.0, 3.0, 4.0, 5.0]])
    out = silu_and_mul(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.silu_and_mul(x), rtol=1e-6, atol=1e-6)


def test_silu_and_mul_on_strided_rows():
    big = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    x = big[:, :246]  # rows 300 apart
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), rtol=1e-6, atol=1e-6)


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 5))
