"""Triton SiLU-and-mul against its twin (CPU interpreter).

Tolerance, relative, in units of the dtype's eps (eps * |x| >= 1 ulp of x):
both sides round SiLU(gate) to the activation dtype and then round the
product. bf16: the interpreter truncates both times (< 1 eps each) where torch
rounds to nearest (<= 1/2 eps each): < 3 eps apart. fp16: nearest rounding on
both sides: 2 eps. fp32: exp implementations differ by an ulp or so: 4.
"""

import pytest
import torch

pytest.importorskip("triton")

from pagefleet.kernels import reference  # noqa: E402
from pagefleet.kernels.activation import silu_and_mul  # noqa: E402

EPS_MULTIPLE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2 * 123), (2, 3, 2 * 1100), (1, 2)])
def test_silu_and_mul_matches_twin(dtype, shape):
    x = (4 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)
    out = silu_and_mul(x)
    expected = reference.silu_and_mul(x)
    assert out.shape == expected.shape == (*shape[:-1], shape[-1] // 2)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, expected, rtol=EPS_MULTIPLE[dtype] * eps, atol=EPS_MULTIPLE[dtype] * eps)


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
