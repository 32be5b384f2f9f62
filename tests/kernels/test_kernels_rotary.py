"""Triton rotary embedding against its twin (CPU interpreter), in place on q/k views of a fused QKV.

Tolerance: both rotate in fp32 from the same fp32 cos/sin table and round once
to the activation dtype; fp32 differences are an ulp or two of the inputs (FMA
contraction on GPUs), which the output's 1-ulp rounding may amplify to 1 ulp,
and the interpreter truncates bf16 stores (1 more): 2 ulps relative plus
2 eps * max|x| absolute for values near zero after cancellation.
"""

import pytest
import torch

pytest.importorskip("triton")

from pagefleet.kernels import reference  # noqa: E402
from pagefleet.kernels.rotary import rotary_embedding  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim: (num_q_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads,
                                                                                       head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads,scaling", [
    (64, 5, 1, None),
    (128, 4, 2, LLAMA3_SCALING),
    (80, 3, 3, None),  # half = 40: not a power of two
])
def test_rotary_matches_twin_in_place(dtype, head_dim, num_q_heads, num_kv_heads, scaling):
    num_tokens, max_position = 11, 40000
    cos_sin = reference.build_cos_sin_cache(head_dim, max_position, 500000.0, scaling)
    positions = torch.tensor([0, 1, 2, 17, 4095, 8191, 8192, 20000, 39999, 5, 5])
    qkv, q, k = _fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed=head_dim)
    expected_qkv, eq, ek = _fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed=head_dim)
    value_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].clone()

    rq, rk = rotary_embedding(positions, q, k, cos_sin)
    reference.rotary_embedding(positions, eq, ek, cos_sin)

    assert rq is q and rk is k
    eps = torch.finfo(dtype).eps
    tol = dict(rtol=2 * eps, atol=2 * eps * 4.0)  # |x| < ~4.5 for these randn inputs
    torch.testing.assert_close(q, eq, **tol)
    torch.testing.assert_close(k, ek, **tol)
    # The value slice of the fused tensor is not touched.
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim:], value_before)


def test_rotary_rejects_bad_table():
    q, k = torch.randn(2, 2, 64), torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding(torch.tensor([0, 1]), q, k, torch.randn(10, 32))
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(torch.tensor([0]), q, k, torch.randn(10, 64))


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_cos_sin_table_equals_transformers(scaling):
    # The table the kernel reads must be what transformers' Llama computes, Llama 3 scaling included.
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, max_position = 128, 131072
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=max_position,
                         rope_theta=500000.0, rope_scaling=scaling)
    positions = torch.tensor([[0, 1, 100, 8191, 8192, 100000, max_position - 1]])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, 1, head_dim), positions)
    table = reference.build_cos_sin_cache(head_dim, max_position, 500000.0, scaling)
    ours_cos, ours_sin = table[positions[0]].chunk(2, dim=-1)
    assert torch.equal(torch.cat([ours_cos, ours_cos], dim=-1), cos[0])
    assert torch.equal(torch.cat([ours_sin, ours_sin], dim=-1), sin[0])
