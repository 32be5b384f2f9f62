"""The product of a few tokens with FP8 weights, the activations left as they are (Triton).

Twin: `reference.fp8_weight_matmul`. A decode step's matmuls are memory-bound: each weight
byte is read once for a handful of tokens. Halving those bytes is FP8's whole gain there, and
quantizing the activations first (what `torch._scaled_mm` needs) only adds kernels and
rounding. So up to `MAX_TOKENS` tokens the weight tile is read as e4m3, widened exactly to the
activations' dtype, and multiplied on the tensor cores with fp32 accumulation; the per-channel
scale multiplies each output once. Larger batches are compute-bound and go to the FP8 tensor
cores with per-token activation scales (worker/model_executor/fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from pagefleet.kernels.triton_kernel import check_last_dim_contiguous, check_same_device, interpreted, triton_kernel

# Above this many tokens a step is no longer bound by reading the weights.
MAX_TOKENS = 64


@triton_kernel(do_not_specialize=("num_tokens",))
def _fp8_weight_matmul_kernel(
    x_ptr,      # [T, K] bf16 / fp16 / fp32
    w_ptr,      # [N, K] float8_e4m3fn
    scale_ptr,  # [N] fp32
    bias_ptr,   # [N] (any tensor when HAS_BIAS is off)
    out_ptr,    # [T, N]
    num_tokens,
    n,
    k,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,         # interpreter: dots on fp32 copies (bf16 is uint16 in numpy)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no tf32 rounding)
    LOAD_NK: tl.constexpr,        # load weight tiles [BLOCK_N, BLOCK_K] (rows along memory), then transpose
):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_tokens
    n_mask = offs_n < n
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if LOAD_NK:
            w = tl.trans(tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + kk[None, :],
                                 mask=n_mask[:, None] & k_mask[None, :], other=0.0))  # [BLOCK_K, BLOCK_N]
        else:
            w = tl.load(w_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        w = w.to(x_ptr.dtype.element_ty)  # exact: every e4m3 value is a bf16, fp16 and fp32 value
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    y = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class FP8MatmulConfig:
    """Launch shape (the default comes from ``default_config``; benchmarks sweep others)."""

    block_n: int     # output columns a program; power of 2, >= 16
    block_k: int     # weight bytes a row per tile; power of 2, >= 16
    num_warps: int
    num_stages: int
    load_nk: bool = False  # weight tiles loaded row-major and transposed in registers


def default_config(n: int) -> FP8MatmulConfig:
    # Few output columns a program (16 for the 4096-wide projections) so that a narrow layer
    # still spreads over every SM: each program streams BLOCK_N rows of the weight.
    return FP8MatmulConfig(block_n=64 if n >= 16384 else 16, block_k=256, num_warps=4, num_stages=4)


def fp8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype,
                      config: FP8MatmulConfig | None = None) -> torch.Tensor:
    """x: [T, K] float, T <= MAX_TOKENS; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32;
    bias: [N] or None -> [T, N] out_dtype: (x @ weight.T) * weight_scale + bias, fp32 sums.
    config: force the launch shape (tests, tuning)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [T, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != torch.float8_e4m3fn or weight_scale.shape != (weight.shape[0],):
        raise ValueError(f"need an e4m3 weight and one scale per output, got {weight.dtype}, "
                         f"scale {tuple(weight_scale.shape)}")
    num_tokens, k = x.shape
    n = weight.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"fp8_weight_matmul serves at most {MAX_TOKENS} tokens, got {num_tokens}")
    device = check_same_device(x=x, weight=weight, weight_scale=weight_scale)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    out = torch.empty((num_tokens, n), dtype=out_dtype, device=device)
    if num_tokens == 0 or n == 0:
        return out
    config = config or default_config(n)
    block_m = max(16, 1 << (num_tokens - 1).bit_length())  # 16 rows: the tl.dot minimum
    grid = (-(-n // config.block_n), -(-num_tokens // block_m))
    _fp8_weight_matmul_kernel.on(device)[grid](
        x_ptr=x, w_ptr=weight, scale_ptr=weight_scale, bias_ptr=bias if bias is not None else weight_scale,
        out_ptr=out, num_tokens=num_tokens, n=n, k=k, stride_x=x.stride(0), stride_w=weight.stride(0),
        stride_out=out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, UPCAST=interpreted(device),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", LOAD_NK=config.load_nk,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
