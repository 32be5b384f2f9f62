"""Causal attention over a paged KV cache: prefill, chunked prefill and decode in one kernel (Triton).

Twin: `reference.paged_attention`. Design:

* A program owns BLOCK_Q query tokens of one sequence and all GROUP query heads
  that share one KV head, packed as BLOCK_M = BLOCK_Q * GROUP_PAD rows of the
  query tile. Each K/V tile is therefore loaded once per KV head and used by
  every query head of the group (GQA/MQA), and decode rows (one token) still
  give `tl.dot` its 16-row minimum.
* Grid axis 0 covers `T // BLOCK_Q + B` query blocks, an upper bound on
  sum_b cdiv(q_len_b, BLOCK_Q) that needs no host sync; a program finds its
  sequence by binary search over `query_start_loc` and exits if it is surplus.
* K/V tiles of BLOCK_N tokens are gathered token by token through the block
  table, so BLOCK_N and block_size are independent (any block_size works).
* Online softmax in fp32 in the log2 domain; fully masked rows are guarded so
  padding rows never produce inf - inf.
* A sliding window (SLIDING, window W) hides keys more than W - 1 positions behind each
  query: a program starts at the tile holding its first query's first visible key, and
  loads nothing before it (those blocks may be freed: their table entries are stale).
* Split-KV (NUM_SPLITS > 1): the context of each query block is cut into
  NUM_SPLITS ranges handled by separate programs, which write unnormalised
  partials that `attention_merge` combines. It exists for decode batches too
  small to fill the GPU (B * Hkv programs << SM count).
* Attention sinks (SINKS, gpt-oss): one learned logit per query head joins the softmax's
  denominator with no value. It folds into the running (max, sum) once after the tiles, in
  split 0 only when the context is split (the merge adds the splits' sums).
* Offsets into the caches are int64 (block_id * stride passes 2^31 on real pools).
* An fp8 (e4m3) cache holds K / k_scale and V / v_scale: its tiles convert to the
  query's dtype (exactly: e4m3 values are a subset of fp16's and bf16's) for the
  dots; k_scale folds into the softmax scale and v_scale into the accumulator
  once at the end (split partials too: the merge is linear in them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl

from pagefleet.kernels.attention_merge import merge_attention_splits
from pagefleet.kernels.triton_kernel import (
    MAX,
    SUM,
    check_kv_scales,
    check_last_dim_contiguous,
    check_same_device,
    interpreted,
    next_power_of_2,
    triton_kernel,
)


@triton_kernel(do_not_specialize=("num_seqs", "stride_block_table"))
def _paged_attention_kernel(
    query_ptr,            # [T, Hq, D]
    key_cache_ptr,        # [N, bs, Hkv, D]
    value_cache_ptr,      # [N, bs, Hkv, D]
    block_table_ptr,      # [B, max_blocks] int32/int64
    query_start_loc_ptr,  # [B + 1] int32/int64
    seq_lens_ptr,         # [B] int32/int64, context length including this step's tokens
    sinks_ptr,            # [Hq] fp32 sink logits; read only when SINKS
    out_ptr,              # [T, Hq, D], written when NUM_SPLITS == 1
    partial_out_ptr,      # [T, Hq, NUM_SPLITS, D] fp32 unnormalised, written when NUM_SPLITS > 1
    partial_max_ptr,      # [T, Hq, NUM_SPLITS] fp32 row max (log2 domain), NUM_SPLITS > 1
    partial_sum_ptr,      # [T, Hq, NUM_SPLITS] fp32 row sum of exp2, NUM_SPLITS > 1
    qk_scale_log2,        # softmax scale * k_scale * log2(e)
    v_scale,              # 1.0 unless the caches are fp8
    sliding_window,       # W: a query sees keys p - W + 1 .. p; read only when SLIDING
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    stride_block_table,
    stride_o_tok,
    stride_o_head,
    stride_po_tok,
    stride_po_head,
    stride_pm_tok,
    stride_pm_head,
    block_size,
    GROUP: tl.constexpr,          # query heads per KV head
    GROUP_PAD: tl.constexpr,      # GROUP rounded up to a power of 2
    BLOCK_Q: tl.constexpr,        # query tokens per program
    BLOCK_M: tl.constexpr,        # BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,        # KV tokens per tile
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,        # HEAD_DIM rounded up to a power of 2
    NUM_SPLITS: tl.constexpr,
    FP8: tl.constexpr,            # the caches are float8_e4m3fn
    SLIDING: tl.constexpr,        # the layer attends over a sliding window of sliding_window keys
    SINKS: tl.constexpr,          # the layer has attention sinks (sinks_ptr)
    UPCAST: tl.constexpr,         # interpreter: compute on fp32 copies (bf16 is uint16 in numpy)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 caches (no tf32 rounding), else the default
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence b owns query blocks starting at query_start_loc[b] // BLOCK_Q + b:
    # find the last b whose first block is <= ours.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens before this step's queries (prefix hits, earlier chunks)

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP_PAD  # query index within the sequence
    head_in_group = offs_m % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (head_in_group < GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx
    tok = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(query_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    # Causality bounds the keys this block needs by its last query row's position.
    kv_len = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    # A window bounds them from below by its first query row's first visible key.
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    first_tile = kv_start // BLOCK_N
    num_tiles = (kv_len + BLOCK_N - 1) // BLOCK_N - first_tile
    tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, first_tile + num_tiles)

    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    for tile in range(tile_start, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = (offs_n < kv_len) & (offs_n >= kv_start)
        block_ids = tl.load(block_table_row + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
        in_block = offs_n % block_size
        k_rows = block_ids * stride_kc_block + in_block * stride_kc_tok + kv_head * stride_kc_head  # [BLOCK_N]
        v_rows = block_ids * stride_vc_block + in_block * stride_vc_tok + kv_head * stride_vc_head
        k = tl.load(key_cache_ptr + k_rows[None, :] + offs_d[:, None],
                    mask=n_valid[None, :] & d_mask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(value_cache_ptr + v_rows[:, None] + offs_d[None, :],
                    mask=n_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if FP8:
            k = k.to(query_ptr.dtype.element_ty)
            v = v.to(query_ptr.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale_log2  # [BLOCK_M, BLOCK_N]
        visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM)
        # P goes through the query's dtype as on the GPU (bf16/fp16 tensor-core operands, the
        # dtype V's tile is in by now).
        p_dot = p.to(query_ptr.dtype.element_ty)
        if UPCAST:
            p_dot = p_dot.to(tl.float32)
        acc = tl.dot(p_dot, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if SINKS:  # noqa: SIM102 (a constexpr switch, then a run-time test: Triton keeps them apart)
        if split == 0:  # the sink counts once: in the first split's sum
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            corr = tl.exp2(m_i - m_fin)
            l_i = l_i * corr + tl.exp2(sink - m_fin)
            acc = acc * corr[:, None]
            m_i = m_fin
    if FP8:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])
    else:
        po = partial_out_ptr + tok[:, None] * stride_po_tok + head[:, None] * stride_po_head + split * HEAD_DIM
        tl.store(po + offs_d[None, :], acc, mask=row_valid[:, None] & d_mask[None, :])
        pm = tok * stride_pm_tok + head * stride_pm_head + split
        tl.store(partial_max_ptr + pm, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + pm, l_i, mask=row_valid)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Launch shape of the attention kernel (the defaults come from `default_config`)."""

    block_m: int     # query rows per program: BLOCK_Q tokens x GROUP_PAD heads; power of 2, >= 16
    block_n: int     # KV tokens per tile; power of 2, >= 16
    num_warps: int
    num_stages: int


def default_config(*, decode_only: bool, group_pad: int, head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    # Decode: 16 rows is the tl.dot minimum, and more rows would only be empty.
    # Prefill: 64 rows amortise each K/V tile over more queries.
    block_m = max(16 if decode_only else 64, group_pad)
    # 64 keys x D=128 bf16 is 16 KB per K or V tile: two tiles in flight per
    # stage stay far inside shared memory, and registers stay under 255 without
    # spills (checked by tests/test_kernels_compile.py for sm_90).
    block_n = 64 if head_dim <= 128 else 32
    num_warps = 4
    if dtype == torch.float32:
        # fp32 ieee dots need twice the registers per element: smaller tiles over more warps, or they spill.
        block_m, block_n, num_warps = max(16, group_pad), 32, 8
    return AttentionConfig(block_m=block_m, block_n=block_n, num_warps=num_warps,
                           num_stages=3 if decode_only else 2)


_LOG2_E = math.log2(math.e)
_MAX_SPLITS = 32
_num_sms_cache: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms_cache:
        _num_sms_cache[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms_cache[index]


def _choose_num_splits(device: torch.device, num_seqs: int, num_kv_heads: int, max_tiles: int) -> int:
    # Only decode-only batches reach here. Below one program per SM the GPU
    # idles, and a decode program streams its whole context alone: cut the
    # context until there are about two programs per SM.
    if device.type != "cuda":
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    target = 2 * _num_sms(device)
    if programs >= target // 2:
        return 1
    splits = next_power_of_2(-(-target // programs))
    return max(1, min(splits, _MAX_SPLITS, next_power_of_2(max_tiles)))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, *, k_scale: float = 1.0, v_scale: float = 1.0,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                    num_kv_splits: int | None = None, config: AttentionConfig | None = None,
                    plan: None = None) -> torch.Tensor:
    """Same contract as `reference.paged_attention`; returns [T, Hq, D].

    query: [T, Hq, D] (a strided view is fine); key_cache, value_cache: [N, bs, Hkv, D] of
    query's dtype, or float8_e4m3fn holding K / k_scale and V / v_scale (other caches ignore
    the scales, Python floats: constant for an engine, so a CUDA graph may hold them);
    block_table: [B, max_blocks]; query_start_loc: [B + 1]; seq_lens: [B] (all int32 or int64).
    sliding_window: W for a sliding-window layer (each query sees its last W positions; blocks
    wholly before that are never read), None for full attention.
    sinks: [Hq] sink logits (gpt-oss), or None.
    num_kv_splits: force the split-KV variant's split count (tests, benchmarks);
    None picks 1 unless the batch is decode-only and too small to fill a CUDA device.
    config: force the launch shape (tests, tuning); None uses `default_config`.
    plan: the step's attention plan (``ops.Kernels``); this kernel plans nothing, so it is None.
    Query rows past query_start_loc[B] (padding) are left unwritten, as in the twin.
    """
    if query.dim() != 3 or key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"need query [T, Hq, D] and caches [N, bs, Hkv, D], got {tuple(query.shape)}, "
                         f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} x {head_dim} do not fit cache heads "
                         f"{num_kv_heads} x {cache_head_dim}")
    if not (key_cache.dtype == value_cache.dtype and key_cache.dtype in (query.dtype, torch.float8_e4m3fn)):
        raise ValueError(f"caches must share the query's dtype or be float8_e4m3fn, got {query.dtype}, "
                         f"{key_cache.dtype}, {value_cache.dtype}")
    check_kv_scales(k_scale, v_scale)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
    if sinks is not None and (sinks.shape != (num_q_heads,) or sinks.device != query.device):
        raise ValueError(f"sinks must be [{num_q_heads}] on {query.device}, got {tuple(sinks.shape)} "
                         f"on {sinks.device}")
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    num_seqs = seq_lens.shape[0]
    index_dtypes = (torch.int32, torch.int64)
    if (block_table.dim() != 2 or block_table.shape[0] != num_seqs or query_start_loc.shape != (num_seqs + 1,)
            or seq_lens.dim() != 1 or any(t.dtype not in index_dtypes
                                         for t in (block_table, query_start_loc, seq_lens))):
        raise ValueError(f"need block_table [B, max_blocks], query_start_loc [B + 1], seq_lens [B] "
                         f"int32/int64; got {tuple(block_table.shape)} {block_table.dtype}, "
                         f"{tuple(query_start_loc.shape)} {query_start_loc.dtype}, "
                         f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    if head_dim < 16:
        raise ValueError(f"head_dim must be at least 16 (tl.dot minimum), got {head_dim}")
    device = check_same_device(query=query, key_cache=key_cache, value_cache=value_cache,
                               block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens)
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_table", block_table)):
        check_last_dim_contiguous(name, t)

    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    decode_only = num_tokens == num_seqs  # every scheduled sequence has >= 1 query token
    if config is None:
        config = default_config(decode_only=decode_only, group_pad=group_pad, head_dim=head_dim, dtype=query.dtype)
    block_m, block_n = config.block_m, config.block_n
    if (block_m < 16 or block_m & (block_m - 1) or block_m % group_pad
            or block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"{config}: block_m and block_n must be powers of 2 >= 16, and block_m a multiple "
                         f"of the padded query-head group {group_pad}")
    block_q = block_m // group_pad
    block_d = next_power_of_2(head_dim)
    max_tiles = -(-block_table.shape[1] * block_size // block_n)
    if num_kv_splits is None:
        num_kv_splits = _choose_num_splits(device, num_seqs, num_kv_heads, max_tiles) if decode_only else 1
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")

    if num_kv_splits > 1:
        partial_out = torch.empty((num_tokens, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32,
                                  device=device)
        partial_max = torch.empty((num_tokens, num_q_heads, num_kv_splits), dtype=torch.float32, device=device)
        partial_sum = torch.empty_like(partial_max)
    else:  # not touched by the kernel; any tensor serves as a placeholder pointer
        partial_out, partial_max, partial_sum = out, out, out

    # Axis 0: query blocks (upper bound, see module doc); axis 1: KV heads, so a
    # program's K/V tiles serve its whole query-head group; axis 2: context splits.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_kv_splits)
    _paged_attention_kernel.on(device)[grid](
        query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache, block_table_ptr=block_table,
        query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
        sinks_ptr=sinks.float().contiguous() if sinks is not None else seq_lens, out_ptr=out,
        partial_out_ptr=partial_out, partial_max_ptr=partial_max, partial_sum_ptr=partial_sum,
        qk_scale_log2=scale * (k_scale if fp8 else 1.0) * _LOG2_E, v_scale=v_scale if fp8 else 1.0,
        sliding_window=sliding_window or 0, num_seqs=num_seqs,
        stride_q_tok=query.stride(0), stride_q_head=query.stride(1),
        stride_kc_block=key_cache.stride(0), stride_kc_tok=key_cache.stride(1), stride_kc_head=key_cache.stride(2),
        stride_vc_block=value_cache.stride(0), stride_vc_tok=value_cache.stride(1),
        stride_vc_head=value_cache.stride(2), stride_block_table=block_table.stride(0),
        stride_o_tok=out.stride(0), stride_o_head=out.stride(1),
        stride_po_tok=partial_out.stride(0), stride_po_head=partial_out.stride(1),
        stride_pm_tok=partial_max.stride(0), stride_pm_head=partial_max.stride(1),
        block_size=block_size,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits, FP8=fp8,
        SLIDING=sliding_window is not None, SINKS=sinks is not None, UPCAST=interpreted(device),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_kv_splits > 1:
        merge_attention_splits(partial_out, partial_max, partial_sum, query_start_loc, out)
    return out
