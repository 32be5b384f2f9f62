"""Combine split-KV attention partials into the final output (Triton).

The second half of paged attention's split-KV variant: each split left an
unnormalised fp32 accumulator, its row max m_s (log2 domain) and row sum l_s.
out = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M), with M = max_s m_s.
A split that saw no visible key has m_s = -inf and l_s = 0 and drops out; split
0 always holds key 0, which every query row sees, so M is finite.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pagefleet.kernels.triton_kernel import MAX, SUM, next_power_of_2, triton_kernel


@triton_kernel(do_not_specialize=("num_seqs",))
def _merge_attention_splits_kernel(
    partial_out_ptr,      # [T, Hq, S, D] fp32
    partial_max_ptr,      # [T, Hq, S] fp32
    partial_sum_ptr,      # [T, Hq, S] fp32
    query_start_loc_ptr,  # [B + 1]; rows from query_start_loc[B] on are padding
    out_ptr,              # [T, Hq, D]
    num_seqs,
    stride_po_tok,
    stride_po_head,
    stride_pm_tok,
    stride_pm_head,
    stride_o_tok,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Padding rows were never written by the attention kernel; their partials are garbage.
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    pm = tok * stride_pm_tok + head * stride_pm_head + offs_s
    m = tl.load(partial_max_ptr + pm, mask=s_mask, other=float("-inf"))
    l = tl.load(partial_sum_ptr + pm, mask=s_mask, other=0.0)
    m_all = tl.reduce(m, 0, MAX)
    weight = tl.exp2(m - m_all)  # [BLOCK_S]; 0 for empty splits
    denom = tl.reduce(l * weight, 0, SUM)
    po = partial_out_ptr + tok * stride_po_tok + head * stride_po_head
    acc = tl.load(po + offs_s[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.reduce(acc * weight[:, None], 0, SUM) / denom
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def merge_attention_splits(partial_out: torch.Tensor, partial_max: torch.Tensor, partial_sum: torch.Tensor,
                           query_start_loc: torch.Tensor, out: torch.Tensor) -> None:
    """partial_out: [T, Hq, S, D] fp32 contiguous; partial_max, partial_sum: [T, Hq, S] fp32;
    query_start_loc: [B + 1]; writes out: [T, Hq, D]."""
    num_tokens, num_heads, num_splits, head_dim = partial_out.shape
    if not partial_out.is_contiguous() or partial_max.shape != (num_tokens, num_heads, num_splits) \
            or partial_sum.stride() != partial_max.stride() or out.shape != (num_tokens, num_heads, head_dim):
        raise ValueError("merge_attention_splits: partials must be the contiguous buffers paged_attention allocates")
    # One program per (token, query head): it reads S x D partials, a few KB.
    _merge_attention_splits_kernel.on(out.device)[(num_tokens, num_heads)](
        partial_out_ptr=partial_out, partial_max_ptr=partial_max, partial_sum_ptr=partial_sum,
        query_start_loc_ptr=query_start_loc, out_ptr=out, num_seqs=query_start_loc.shape[0] - 1,
        stride_po_tok=partial_out.stride(0), stride_po_head=partial_out.stride(1),
        stride_pm_tok=partial_max.stride(0), stride_pm_head=partial_max.stride(1),
        stride_o_tok=out.stride(0), stride_o_head=out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits), HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim), num_warps=4,
    )
