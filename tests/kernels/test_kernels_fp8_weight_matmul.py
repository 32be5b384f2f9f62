"""The few-token FP8-weight product (Triton, CPU interpreter) against its twin.

Both sides form every product x * w exactly in fp32 (a bf16/fp16 value times an e4m3 value
fits fp32's 24 bits) and sum in fp32 in different orders: each of the K partial sums may round
once, so they differ by at most K eps32 sum|x w| (times the scale). Rounding the result to the
output dtype once more may then land one ulp apart: eps_out |expected|.
"""

import pytest
import torch

pytest.importorskip("triton")

from pagefleet.kernels import reference  # noqa: E402
from pagefleet.kernels.fp8_weight_matmul import (  # noqa: E402
    MAX_TOKENS,
    FP8MatmulConfig,
    fp8_weight_matmul,
)

FP8 = torch.float8_e4m3fn
EPS32 = torch.finfo(torch.float32).eps


def _operands(tokens, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, k, generator=g) * 3).to(dtype)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g)
    return x, w, scale, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "n", "k"), [(1, 48, 80), (5, 80, 300), (17, 16, 512), (MAX_TOKENS, 40, 33)])
def test_fp8_weight_matmul_matches_twin(dtype, tokens, n, k):
    x, w, scale, bias = _operands(tokens, n, k, dtype)
    for b in (None, bias):
        got = fp8_weight_matmul(x, w, scale, b, dtype)
        want = reference.fp8_weight_matmul(x, w, scale, b, dtype)
        assert got.shape == want.shape == (tokens, n) and got.dtype == dtype
        bound = (k * EPS32 * (x.float().abs() @ w.float().abs().t()) * scale
                 + torch.finfo(dtype).eps * want.float().abs())
        assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("config", [FP8MatmulConfig(32, 64, 4, 2, load_nk=True), FP8MatmulConfig(16, 128, 8, 3)])
def test_every_launch_shape_computes_the_same_product(config):
    x, w, scale, bias = _operands(9, 80, 300, torch.bfloat16, seed=1)
    got = fp8_weight_matmul(x, w, scale, bias, torch.bfloat16, config=config)
    want = reference.fp8_weight_matmul(x, w, scale, bias, torch.bfloat16)
    bound = (300 * EPS32 * (x.float().abs() @ w.float().abs().t()) * scale
             + torch.finfo(torch.bfloat16).eps * want.float().abs())
    assert ((got.float() - want.float()).abs() <= bound).all()


def test_the_twin_is_the_dequantized_product():
    x, w, scale, bias = _operands(3, 24, 40, torch.float32)
    want = x.double() @ (w.double() * scale.double()[:, None]).t() + bias.double()
    got = reference.fp8_weight_matmul(x, w, scale, bias, torch.float32).double()
    assert ((got - want).abs() <= 42 * EPS32 * (x.double().abs() @ (w.double().abs() * scale.double()[:, None]).t()
                                                + bias.double().abs())).all()


def test_fp8_weight_matmul_refuses_what_it_cannot_take():
    x, w, scale, _ = _operands(2, 16, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        fp8_weight_matmul(torch.zeros(MAX_TOKENS + 1, 32, dtype=torch.bfloat16), w, scale, None, torch.bfloat16)
    with pytest.raises(ValueError, match="e4m3 weight"):
        fp8_weight_matmul(x, w.float(), scale, None, torch.bfloat16)
    with pytest.raises(ValueError, match="need x"):
        fp8_weight_matmul(x, w[:, :16], scale, None, torch.bfloat16)


def test_the_engine_and_the_kernel_agree_on_where_weight_only_ends():
    from pagefleet.worker.model_executor.fp8 import WEIGHT_ONLY_MAX_TOKENS

    assert WEIGHT_ONLY_MAX_TOKENS == MAX_TOKENS
