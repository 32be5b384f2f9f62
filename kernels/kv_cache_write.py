"""Store each token's K and V into the paged cache at its slot (Triton).

Twin: `reference.write_kv_cache`. slot = block_id * block_size + offset; a
negative slot marks a padding token, which is skipped. A cache of the input's
dtype gets a bit copy; a float8_e4m3fn cache gets x * (1 / scale), clamped to
+-448 and rounded to nearest even, bit for bit what the twin stores.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pagefleet.kernels.triton_kernel import (
    check_kv_scales,
    check_last_dim_contiguous,
    check_same_device,
    interpreted,
    next_power_of_2,
    triton_kernel,
)


@triton_kernel
def _write_kv_cache_kernel(
    key_ptr,            # [T, Hkv, D]
    value_ptr,          # [T, Hkv, D]
    key_cache_ptr,      # [N, bs, Hkv, D]
    value_cache_ptr,    # [N, bs, Hkv, D]
    slot_mapping_ptr,   # [T] int64 (negative: padding)
    k_inv_scale,        # 1 / k_scale (FP8 only)
    v_inv_scale,        # 1 / v_scale (FP8 only)
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    num_kv_heads,
    block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,             # the caches are float8_e4m3fn
    ROUND_TO_E4M3: tl.constexpr,   # interpreter: round on the e4m3 grid before the cast (see below)
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    # int64 from here on: block_id * stride_block passes 2^31 elements on real pools.
    block_id = slot // block_size
    block_offset = slot % block_size

    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < num_kv_heads) & (offs_d < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_k_tok + offs_h * stride_k_head + offs_d, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + offs_h * stride_v_head + offs_d, mask=mask)
    kc = key_cache_ptr + block_id * stride_kc_block + block_offset * stride_kc_tok + offs_h * stride_kc_head + offs_d
    vc = value_cache_ptr + block_id * stride_vc_block + block_offset * stride_vc_tok + offs_h * stride_vc_head + offs_d
    if FP8:
        # Clamp first (reference.FP8_E4M3_MAX): past 448 casts disagree (NaN, wrapped values).
        k = tl.minimum(tl.maximum(k.to(tl.float32) * k_inv_scale, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * v_inv_scale, -448.0), 448.0)
        if ROUND_TO_E4M3:
            # Triton 3.9's interpreter casts fp32 -> e4m3 wrongly (a rounding carry does not reach
            # the exponent, ties round up, subnormals truncate) but casts values already on the
            # e4m3 grid exactly: round |x| to the grid here, nearest even, and keep the sign (-0 too).
            # ulp = 2^(exponent - 3), exponents below e4m3's smallest normal (2^-6) taking its ulp 2^-9;
            # adding 1.5 * 2^23 rounds |x| / ulp < 16 to an integer in fp32.
            k_bits = k.to(tl.int32, bitcast=True)
            k_ulp_field = tl.maximum((k_bits >> 23) & 0xFF, 127 - 6) - 3
            k_mag = tl.where(k_bits < 0, -k, k) * ((254 - k_ulp_field) << 23).to(tl.float32, bitcast=True)
            k_mag = ((k_mag + 12582912.0) - 12582912.0) * (k_ulp_field << 23).to(tl.float32, bitcast=True)
            k = tl.where(k_bits < 0, -k_mag, k_mag)
            v_bits = v.to(tl.int32, bitcast=True)
            v_ulp_field = tl.maximum((v_bits >> 23) & 0xFF, 127 - 6) - 3
            v_mag = tl.where(v_bits < 0, -v, v) * ((254 - v_ulp_field) << 23).to(tl.float32, bitcast=True)
            v_mag = ((v_mag + 12582912.0) - 12582912.0) * (v_ulp_field << 23).to(tl.float32, bitcast=True)
            v = tl.where(v_bits < 0, -v_mag, v_mag)
        # The GPU's cast rounds to nearest even, as torch's does.
        k = k.to(key_cache_ptr.dtype.element_ty)
        v = v.to(value_cache_ptr.dtype.element_ty)
    # Otherwise the same dtype in and out (checked by the launcher): a bit copy, no rounding.
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """key, value: [T, Hkv, D] (strided views allowed); key_cache, value_cache: [N, bs, Hkv, D] of
    key's dtype or float8_e4m3fn; slot_mapping: [T] int64. k_scale, v_scale: an fp8 cache stores
    K / k_scale and V / v_scale (other caches ignore them). Slots are not bounds checked (that
    would cost a device sync)."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"caches must be [N, bs, Hkv={key.shape[1]}, D={key.shape[2]}], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if not (key.dtype == value.dtype and key_cache.dtype == value_cache.dtype
            and key_cache.dtype in (key.dtype, torch.float8_e4m3fn)):
        raise ValueError(f"key/value/cache dtypes differ: {key.dtype}, {value.dtype}, "
                         f"{key_cache.dtype}, {value_cache.dtype} (caches take the key's dtype or float8_e4m3fn)")
    check_kv_scales(k_scale, v_scale)
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}] int32/int64, "
                         f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    device = check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                               slot_mapping=slot_mapping)
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, t)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # One program per token: a token's K and V (Hkv * D elements each) are one
    # tile, and its slot is read once; padding tokens exit after that read.
    _write_kv_cache_kernel.on(device)[(num_tokens,)](
        key_ptr=key, value_ptr=value, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
        slot_mapping_ptr=slot_mapping, k_inv_scale=1.0 / k_scale, v_inv_scale=1.0 / v_scale,
        stride_k_tok=key.stride(0), stride_k_head=key.stride(1),
        stride_v_tok=value.stride(0), stride_v_head=value.stride(1),
        stride_kc_block=key_cache.stride(0), stride_kc_tok=key_cache.stride(1), stride_kc_head=key_cache.stride(2),
        stride_vc_block=value_cache.stride(0), stride_vc_tok=value_cache.stride(1),
        stride_vc_head=value_cache.stride(2),
        num_kv_heads=num_kv_heads, block_size=key_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        FP8=key_cache.dtype == torch.float8_e4m3fn, ROUND_TO_E4M3=interpreted(device),
        num_warps=4,
    )
