"""Neox-style (rotate-half) rotary embedding of q and k, in place, by position (Triton).

Twin: `reference.rotary_embedding`; the cos/sin table comes from
`reference.build_cos_sin_cache` (default rope and Llama 3 scaling, as transformers
computes them). Rotation in fp32, one rounding to the activation dtype on store.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pagefleet.kernels.triton_kernel import (
    check_last_dim_contiguous,
    check_same_device,
    next_power_of_2,
    triton_kernel,
)


@triton_kernel
def _rotary_kernel(
    positions_ptr,     # [T] int64
    query_ptr,         # [T, Hq, D], rotated in place
    key_ptr,           # [T, Hkv, D], rotated in place
    cos_sin_ptr,       # [max_position, D] fp32: cos in [0, D/2), sin in [D/2, D)
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cos_sin,
    num_q_heads,
    num_kv_heads,
    HALF_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF_DIM
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF_DIM + offs_d, mask=d_mask, other=0.0)[None, :]

    # Query heads: x1 is the first half of each head, x2 the second.
    offs_hq = tl.arange(0, BLOCK_HQ)
    q_mask = (offs_hq < num_q_heads)[:, None] & d_mask[None, :]
    q1_ptrs = query_ptr + tok * stride_q_tok + offs_hq[:, None] * stride_q_head + offs_d[None, :]
    q1 = tl.load(q1_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptrs + HALF_DIM, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q1_ptrs, (q1 * cos - q2 * sin).to(query_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q1_ptrs + HALF_DIM, (q2 * cos + q1 * sin).to(query_ptr.dtype.element_ty), mask=q_mask)

    offs_hk = tl.arange(0, BLOCK_HKV)
    k_mask = (offs_hk < num_kv_heads)[:, None] & d_mask[None, :]
    k1_ptrs = key_ptr + tok * stride_k_tok + offs_hk[:, None] * stride_k_head + offs_d[None, :]
    k1 = tl.load(k1_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptrs + HALF_DIM, mask=k_mask, other=0.0).to(tl.float32)
    tl.store(k1_ptrs, (k1 * cos - k2 * sin).to(key_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k1_ptrs + HALF_DIM, (k2 * cos + k1 * sin).to(key_ptr.dtype.element_ty), mask=k_mask)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] in place; positions [T] index cos_sin_cache [P, D] fp32.

    query and key may be strided views (e.g. slices of the fused QKV output);
    only their last dimension must be contiguous. Positions are not bounds
    checked here (that would cost a device sync); the engine keeps them below
    max_position, as the twin's index_select requires too.
    """
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"rotary_embedding needs query [T, Hq, D] and key [T, Hkv, D], "
                         f"got {tuple(query.shape)} and {tuple(key.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [T={num_tokens}] int32/int64, "
                         f"got {tuple(positions.shape)} {positions.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be [max_position, {head_dim}] float32, "
                         f"got {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype}")
    device = check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return query, key
    half = head_dim // 2
    # One program per token: it reads the token's cos/sin row once and rotates
    # every q and k head with it (a few KB per token, one tile each).
    _rotary_kernel.on(device)[(num_tokens,)](
        positions_ptr=positions, query_ptr=query, key_ptr=key, cos_sin_ptr=cos_sin_cache,
        stride_q_tok=query.stride(0), stride_q_head=query.stride(1),
        stride_k_tok=key.stride(0), stride_k_head=key.stride(1), stride_cos_sin=cos_sin_cache.stride(0),
        num_q_heads=num_q_heads, num_kv_heads=key.shape[1],
        HALF_DIM=half, BLOCK_HALF=next_power_of_2(half),
        BLOCK_HQ=next_power_of_2(num_q_heads), BLOCK_HKV=next_power_of_2(key.shape[1]),
        num_warps=4,
    )
    return query, key
