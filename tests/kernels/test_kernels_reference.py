"""The CPU engine's own RMSNorm (kernels.reference) against transformers' LlamaRMSNorm: bit for bit.

In fp32 it runs aten's fused rms_norm; in half types the explicit formula that rounds to the
half type before the weight, as transformers does. Greedy output equal to transformers' rests
on this being exact, not merely close."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagefleet.kernels import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 512), (17, 896), (256, 4096), (5, 100), (7, 8, 64)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_rms_norm_equals_transformers_bit_for_bit(dtype, shape, scale):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (scale * torch.randn(shape, generator=gen)).to(dtype)
    hf = LlamaRMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.2 * torch.randn(shape[-1], generator=gen))
        expected = hf(x)
    ours = reference.rms_norm(x, hf.weight.detach(), 1e-6)
    assert ours.dtype == expected.dtype
    assert torch.equal(ours, expected)


def test_fused_add_rms_norm_returns_the_sum_and_its_norm():
    gen = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(9, 512, generator=gen) for _ in range(3))
    normed, new_residual = reference.fused_add_rms_norm(x, residual, weight[0], 1e-5)
    assert torch.equal(new_residual, x + residual)
    hf = LlamaRMSNorm(512, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(weight[0])
        assert torch.equal(normed, hf(x + residual))
