"""PyTorch twins of the Triton kernels: the slow-but-obvious definitions.

On CPU the engine runs these; on CUDA the Triton kernels must match them.
Shapes use T = tokens in the step, B = sequences, Hq/Hkv = query/KV heads,
D = head_dim, N = cache blocks, bs = block_size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H], weight: [H]. fp32 statistics, cast back before the weight, as transformers does.
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # aten's fused kernel: in fp32 bit for bit the lines below (tests/test_kernels_reference.py),
        # in one pass. Half types keep the lines below: transformers rounds before the weight.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [T, H] -> (rms_norm(x + residual), x + residual)
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def fp8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x: [T, K] float; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32; bias: [N] or None
    -> [T, N] out_dtype: the activations as they are times the e4m3 weight, summed in fp32, then
    scaled per output channel (plus bias) and rounded once."""
    y = (x.float() @ weight.float().t()) * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2*I] (gate | up) -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def clamped_swiglu(x: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation. x: [T, 2*I] (gate | up) -> [T, I]: the gate clamped above at
    ``limit``, the up projection to +-limit, then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              swiglu_limit: float | None = None, swiglu_alpha: float = 1.0, packed: Any = None) -> torch.Tensor:
    """A mixture-of-experts MLP: each token through its top-k experts' SwiGLU, weighted and summed.

    Tokens are sorted by expert, so each expert runs one product over the tokens routed to it;
    contributions are added in expert order (as transformers' reference does).

    x: [T, H]; w13: [E, 2*I, H] (gate | up); w2: [E, H, I]; topk_weights: [T, K] fp32;
    topk_ids: [T, K] int64. gpt-oss's experts add biases (w13_bias [E, 2*I], w2_bias [E, H],
    before the router's weight) and use ``clamped_swiglu`` (swiglu_limit set) in place of
    SwiGLU. ``packed``: the experts' weights in another layout, with ``gate_up(x, expert)`` and
    ``down(h, expert)`` computing the two products (a CPU engine's oneDNN copies,
    ``worker.cpu.linear.PackedExperts``). Returns [T, H] in x's dtype."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # one host read a layer
    tokens = order // topk_ids.shape[1]
    weights = topk_weights.reshape(-1)[order].to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        rows = tokens[start:start + n]
        gate_up = x[rows] @ w13[expert].t() if packed is None else packed.gate_up(x[rows], expert)
        if w13_bias is not None:
            gate_up += w13_bias[expert]
        hidden = silu_and_mul(gate_up) if swiglu_limit is None else clamped_swiglu(gate_up, swiglu_limit,
                                                                                   swiglu_alpha)
        down = hidden @ w2[expert].t() if packed is None else packed.down(hidden, expert)
        if w2_bias is not None:
            down += w2_bias[expert]
        out.index_add_(0, rows, down * weights[start:start + n, None])
        start += n
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, in place.

    positions: [T] int64; query: [T, Hq, D]; key: [T, Hkv, D];
    cos_sin_cache: [max_position, D] fp32, cos in the first D/2 columns, sin in the rest.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (query, key):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    return query, key


# The largest finite float8_e4m3fn value. The twin and the Triton kernel both clamp to it before
# the cast, so what lands in the cache does not hang on a cast's overflow rule: older torch
# releases give NaN past it (this one saturates), Triton 3.9's interpreter wraps (500 -> 256).
FP8_E4M3_MAX = 448.0


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: unchanged for a cache of x's dtype; for a float8_e4m3fn cache
    x * (1 / scale) in fp32, clamped to +-448, rounded to nearest even (one multiply by the
    reciprocal rather than a division: Triton's fp32 `/` is not correctly rounded on GPU, a
    multiply is, so twin and kernel store the same bits)."""
    if cache_dtype != torch.float8_e4m3fn:
        return x
    return (x.float() * (1.0 / scale)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Store each token's K/V at its slot (block * bs + offset); negative slots are padding.

    key, value: [T, Hkv, D]; key_cache, value_cache: [N, bs, Hkv, D] of key's dtype or
    float8_e4m3fn; slot_mapping: [T] int64. An fp8 cache stores ``quantize_kv(x, scale)``
    (k_scale for K, v_scale for V); other caches ignore the scales.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key = quantize_kv(key, k_scale, key_cache.dtype)
    value = quantize_kv(value, v_scale, value_cache.dtype)
    # index_copy_ is not implemented for float8 on CPU: copy the bytes (the dtypes now match exactly).
    if key_cache.dtype == torch.float8_e4m3fn:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache: [N, bs, Hkv, D]; table: [..., M] int64 -> [..., M * bs, Hkv, D] contiguous, in ``dtype``
    (an fp8 cache's blocks convert exactly: e4m3 values are a subset of fp16's and bf16's)."""
    # index_select over whole blocks: faster on CPU than advanced indexing.
    rows = cache.reshape(cache.shape[0], -1).index_select(0, table.reshape(-1)).to(dtype)
    return rows.view(*table.shape[:-1], table.shape[-1] * cache.shape[1], *cache.shape[2:])


def _length_groups(rows: list[int], lens: list[int], max_padding: float = 1.25) -> list[list[int]]:
    """Split rows (sorted by length) into runs whose padded size stays within max_padding
    of their real size: gathering every decode row to the batch's longest context would
    copy and attend over up to twice the tokens when lengths spread widely."""
    groups: list[list[int]] = []
    total = 0
    for b in rows:
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * lens[b] <= max_padding * (total + lens[b]):
            group.append(b)
            total += lens[b]
        else:
            groups.append([b])
            total = lens[b]
    return groups


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, *, k_scale: float = 1.0, v_scale: float = 1.0,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                    plan: None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    query: [T, Hq, D]; key_cache, value_cache: [N, bs, Hkv, D] of query's dtype or
    float8_e4m3fn, whose stored values are K / k_scale and V / v_scale (``write_kv_cache``):
    blocks are dequantized to the query's dtype, k_scale folds into the softmax scale and
    v_scale multiplies the output, as in the Triton kernel. Other caches ignore the scales.
    block_table: [B, max_blocks] int32; query_start_loc: [B+1] int32; seq_lens: [B] int32
    (context length including this step's tokens, which are already in the cache).
    Query token i of sequence b sits at position seq_lens[b] - q_len[b] + i.
    sliding_window: W where the layer slides: the query at position p sees keys p - W + 1 .. p
    only, and blocks wholly before its window are never read (the KV manager may have freed
    them); None for full attention.
    sinks: [Hq] fp32 or None: gpt-oss's attention sinks, one learned logit per query head that
    joins the softmax's denominator (it takes weight from the keys and adds no value).
    plan: the step's attention plan (``ops.Kernels``); the twin plans nothing, so it is None.
    Returns [T, Hq, D].

    Decode rows (one query token) run as a few batched calls, grouped by the span they read
    so that padding to a group's longest row stays small; each multi-token row (prefill or a
    prefill chunk) runs on its own.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    q_lens = [starts[b + 1] - starts[b] for b in range(num_seqs)]
    out = torch.empty_like(query)
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8:
        scale = scale * k_scale
    decode = [b for b in range(num_seqs) if q_lens[b] == 1]
    decode_attention_rows(query, key_cache, value_cache, block_table, starts, lens, scale, sliding_window,
                          decode, out, sinks)
    multi_token_attention(query, key_cache, value_cache, block_table, starts, lens, scale,
                          [b for b in range(num_seqs) if q_lens[b] != 1], out, sliding_window, sinks)
    if fp8 and v_scale != 1.0:
        out.mul_(v_scale)
    return out


def first_visible_block(first_query_pos: int, block_size: int, sliding_window: int | None) -> int:
    """The first block a query at ``first_query_pos`` (or any later one) may see."""
    if sliding_window is None:
        return 0
    return max(0, first_query_pos - sliding_window + 1) // block_size


def decode_attention_rows(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, starts: list[int], lens: list[int], scale: float,
                          sliding_window: int | None, seqs: list[int], out: torch.Tensor,
                          sinks: torch.Tensor | None = None) -> None:
    """The one-token rows ``seqs`` of ``paged_attention``, written into ``out`` [T, Hq, D]. Each row
    gathers its blocks from the first its window sees (block 0 without a window)."""
    device = query.device  # index and mask tensors live with the data (the twin also runs on CUDA)
    bs = key_cache.shape[1]
    gqa = query.shape[1] != key_cache.shape[2]
    first = [first_visible_block(n - 1, bs, sliding_window) * bs for n in lens]  # each row's first token read
    spans = [n - f for n, f in zip(lens, first)]
    for group in _length_groups(sorted(seqs, key=spans.__getitem__), spans):
        span = spans[group[-1]]
        idx = torch.tensor(group, dtype=torch.long, device=device)
        first_tok = torch.tensor([first[b] for b in group], device=device)
        cols = (first_tok // bs).unsqueeze(1) + torch.arange(-(-span // bs), device=device)
        tables = block_table.index_select(0, idx).long().gather(1, cols.clamp_(max=block_table.shape[1] - 1))
        k = _gather_blocks(key_cache, tables, query.dtype)[:, :span]  # [Bd, span, Hkv, D]
        v = _gather_blocks(value_cache, tables, query.dtype)[:, :span]
        pos = first_tok.unsqueeze(1) + torch.arange(span, device=device)  # [Bd, span]
        ctx = torch.tensor([lens[b] for b in group], device=device).unsqueeze(1)
        mask = pos < ctx
        if sliding_window is not None:
            mask &= pos >= ctx - sliding_window
        q_rows = torch.tensor([starts[b] for b in group], dtype=torch.long, device=device)
        q = query.index_select(0, q_rows).unsqueeze(2)  # [Bd, Hq, 1, D]
        o = attend(q, k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], scale, gqa, sinks)
        out.index_copy_(0, q_rows, o.squeeze(2))


def multi_token_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, starts: list[int], lens: list[int], scale: float,
                          seqs: list[int], out: torch.Tensor, sliding_window: int | None = None,
                          sinks: torch.Tensor | None = None) -> None:
    """The rows of ``paged_attention`` with several new tokens (prompts, prefill chunks), one
    sequence at a time, written into ``out`` [T, Hq, D]; ``seqs`` are their indices and
    ``starts``/``lens`` the step's query_start_loc and seq_lens as lists. Over an fp8 cache,
    ``scale`` already holds k_scale and the caller applies v_scale to ``out``."""
    device = query.device
    block_size = key_cache.shape[1]
    gqa = query.shape[1] != key_cache.shape[2]
    for b in seqs:
        q_len = starts[b + 1] - starts[b]
        ctx_len = lens[b]
        first_block = first_visible_block(ctx_len - q_len, block_size, sliding_window)
        first_tok = first_block * block_size
        table = block_table[b, first_block:(ctx_len + block_size - 1) // block_size].long()
        # 4-D [1, H, L, D]: with a batch dimension CPU SDPA takes its flash kernel (3-D inputs fall
        # back to its much slower math path)
        span = ctx_len - first_tok
        k = _gather_blocks(key_cache, table, query.dtype)[:span].transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = _gather_blocks(value_cache, table, query.dtype)[:span].transpose(0, 1)[None]
        q = query[starts[b]:starts[b + 1]].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        if q_len == ctx_len and sliding_window is None and sinks is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
            key_pos = torch.arange(first_tok, ctx_len, device=device).unsqueeze(0)
            mask = key_pos <= pos  # [q_len, L]
            if sliding_window is not None:
                mask &= key_pos > pos - sliding_window
            o = attend(q, k, v, mask, scale, gqa, sinks)
        out[starts[b]:starts[b + 1]] = o[0].transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, gqa: bool,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """q: [B, Hq, L, D]; k, v: [B, Hkv, S, D]; mask: bool, broadcast to [B, Hq, L, S] (True: seen);
    sinks: [Hq] or None. Without sinks, SDPA; with them, the softmax over the scores and each
    head's sink logit, whose share of the weight is dropped (as transformers' gpt-oss computes
    it), a chunk of query rows at a time so that the scores stay near _SINK_CHUNK_SCORES
    elements. Returns [B, Hq, L, D]."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    k, v = k.float(), v.float()
    sink = sinks.float().view(1, -1, 1, 1)
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    rows = max(1, _SINK_CHUNK_SCORES // (q.shape[0] * q.shape[1] * k.shape[2]))
    out = torch.empty_like(q)
    for r in range(0, q.shape[2], rows):
        scores = (q[:, :, r:r + rows].float() @ k.transpose(-1, -2) * scale).masked_fill(~mask[:, :, r:r + rows],
                                                                                        float("-inf"))
        logits = torch.cat((scores, sink.expand(*scores.shape[:-1], 1)), dim=-1)
        out[:, :, r:r + rows] = logits.softmax(dim=-1)[..., :-1] @ v
    return out


_SINK_CHUNK_SCORES = 1 << 24  # fp32 scores a chunk of ``attend``'s rows holds: 64 MiB


def build_cos_sin_cache(head_dim: int, max_position: int, base: float,
                        rope_scaling: dict | None = None) -> torch.Tensor:
    """[max_position, head_dim] fp32 table for ``rotary_embedding``: cos | sin halves.

    Supports the default rope and Llama 3 frequency scaling, computed as transformers does.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope_type == "yarn":
        inv_freq, attention_factor = yarn_inv_freq(head_dim, base, rope_scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, llama3, yarn)")
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def yarn_inv_freq(head_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies [head_dim / 2] and the factor on cos and sin, as transformers'
    ``_compute_yarn_parameters`` computes them: each frequency interpolated (divided by
    ``factor``) or kept, by a linear ramp between the dimensions that turn beta_fast and
    beta_slow times over the original context (rounded outwards unless ``truncate`` is False)."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
