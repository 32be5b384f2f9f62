"""RMSNorm, optionally fused with the residual add before it (Triton).

Twins: `reference.rms_norm` and `reference.fused_add_rms_norm`. Numerics
follow transformers: statistics in fp32, the normalised row cast back to the
activation dtype before the weight multiplies it, and `x + residual` rounded to
the activation dtype (as torch's bf16 add does) before it is normalised.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pagefleet.kernels.triton_kernel import (
    SUM,
    check_last_dim_contiguous,
    check_same_device,
    next_power_of_2,
    triton_kernel,
)


@triton_kernel
def _rms_norm_kernel(
    x_ptr,             # [T, H]
    residual_ptr,      # [T, H], read only when ADD_RESIDUAL
    weight_ptr,        # [H]
    out_ptr,           # [T, H]
    new_residual_ptr,  # [T, H], written only when ADD_RESIDUAL
    stride_x,
    stride_residual,
    stride_out,
    stride_new_residual,
    hidden_size,
    eps,
    BLOCK_H: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    act_dtype = x_ptr.dtype.element_ty

    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(act_dtype)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, summed, mask=mask)
        x = summed.to(tl.float32)

    mean_square = tl.reduce(x * x, 0, SUM) / hidden_size
    normed = (x * tl.rsqrt(mean_square + eps)).to(act_dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block_h: int) -> int:
    # About 16 elements per thread: enough bytes in flight per warp for HBM, few enough registers.
    return max(1, min(16, block_h // 512))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm needs x [..., H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
                         f"got {tuple(residual.shape)}, {residual.dtype}")
    device = check_same_device(x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    hidden_size = x.shape[-1]
    # One row per program: a row (H <= a few 10k) fits one tile, so the mean square
    # is a single in-register reduction and x is read once.
    x2 = x.reshape(-1, hidden_size)
    check_last_dim_contiguous("x", x2)
    check_last_dim_contiguous("weight", weight)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden_size)
        check_last_dim_contiguous("residual", r2)
        new_residual = torch.empty(x2.shape, dtype=x.dtype, device=device)
    else:
        r2, new_residual = x2, out  # unused by the kernel when ADD_RESIDUAL is off
    num_rows = x2.shape[0]
    if num_rows > 0:
        block_h = next_power_of_2(hidden_size)
        _rms_norm_kernel.on(device)[(num_rows,)](
            x_ptr=x2, residual_ptr=r2, weight_ptr=weight, out_ptr=out, new_residual_ptr=new_residual,
            stride_x=x2.stride(0), stride_residual=r2.stride(0), stride_out=out.stride(0),
            stride_new_residual=new_residual.stride(0), hidden_size=hidden_size, eps=eps,
            BLOCK_H=block_h, ADD_RESIDUAL=residual is not None, num_warps=_num_warps(block_h),
        )
    out = out.view(x.shape)
    return out, (new_residual.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., H], weight: [H] -> [..., H]
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [..., H] -> (rms_norm(x + residual), x + residual); inputs are not modified.
    out, new_residual = _launch(x, residual, weight, eps)
    return out, new_residual
