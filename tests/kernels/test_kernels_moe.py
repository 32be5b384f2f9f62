"""The fused MoE twin (kernels/reference.fused_moe) against the plainest statement of a
mixture of experts: for each token and each of its top-k experts, that expert's SwiGLU MLP
times the router weight, summed. Odd shapes, experts no token chose, a token whose top-k
weights are not normalized, and the tensor-parallel split of the intermediate dimension
(two halves' outputs add up to the whole).

Tolerance: fp32 sums in another order, a few ulps of outputs of order 1: 1e-5 absolute;
bf16 against the fp32 loop: both round each product to bf16, 2 eps of bf16 relative."""

import pytest
import torch
import torch.nn.functional as F

from pagefleet.kernels import reference


def _loop(x, w13, w2, topk_weights, topk_ids):
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = w13[e].float() @ x[t].float()
            out[t] += float(topk_weights[t, k]) * (w2[e].float() @ (F.silu(h[:inter]) * h[inter:]))
    return out


def _case(tokens, experts, top_k, hidden, inter, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(7, 5, 3, 24, 10), (1, 8, 2, 16, 6),
                                                                 (33, 3, 1, 40, 18), (5, 16, 4, 8, 4)])
def test_fused_moe_twin_matches_the_per_token_loop(tokens, experts, top_k, hidden, inter):
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter)
    out = reference.fused_moe(x, w13, w2, weights, ids)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out, _loop(x, w13, w2, weights, ids), rtol=0, atol=1e-5)


def test_experts_no_token_chose_add_nothing():
    x, w13, w2, weights, ids = _case(6, 6, 2, 16, 8)
    ids = torch.tensor([[0, 5]] * 6)  # experts 1-4 idle
    poisoned = w13.clone()
    poisoned[1:5] = float("nan")  # an idle expert's weights are never read
    torch.testing.assert_close(reference.fused_moe(x, poisoned, w2, weights, ids), _loop(x, w13, w2, weights, ids),
                               rtol=0, atol=1e-5)


def test_the_intermediate_split_of_tensor_parallelism_adds_up():
    x, w13, w2, weights, ids = _case(9, 4, 2, 16, 12)
    half = 6
    parts = []
    for rank in range(2):
        rows = torch.cat([torch.arange(rank * half, (rank + 1) * half), 12 + torch.arange(rank * half, (rank + 1) * half)])
        parts.append(reference.fused_moe(x, w13[:, rows], w2[:, :, rank * half:(rank + 1) * half], weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], reference.fused_moe(x, w13, w2, weights, ids), rtol=0, atol=1e-5)


def test_bf16_stays_within_two_eps_of_the_fp32_loop():
    x, w13, w2, weights, ids = _case(11, 6, 2, 32, 16)
    out = reference.fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    expected = _loop(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(out.float(), expected, rtol=2 * eps, atol=2 * eps)
