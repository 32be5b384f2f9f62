"""FP8 weights (``--quantization fp8``): e4m3 weights with one fp32 scale per output channel.
Decode-sized steps multiply them with the activations as they are (weight-only: the step is
bound by reading the weights); larger ones quantize the activations per token on the fly, as
vLLM's FP8 W8A8 with dynamic per-token scales.

On a CUDA device of compute capability 8.9+ (Ada, Hopper) the larger products are
``torch._scaled_mm`` with row-wise scales, the tensor cores' FP8 path, and the decode-sized ones
a Triton kernel. Elsewhere PyTorch twins compute the same math in fp32: the references the CUDA
paths are compared against, and what CPU engines run (slow; they dequantize the weight on every
call, for tests). This file imports Triton only when a CUDA tensor first needs it.
"""

from __future__ import annotations

import functools

import torch

from pagefleet.kernels import reference

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_CAPABILITY = (8, 9)
# A token whose activations are all zero still needs a non-zero scale (its row then quantizes
# to zeros); any tiny positive floor does, this one is far below any real activation.
_MIN_ABSMAX = 1e-12
# torch._scaled_mm needs the weight's dimensions in multiples of 16 (the token count may be
# anything with row-wise scales).
_SCALED_MM_ALIGN = 16
# Token counts up to this read FP8 weights with the activations as they are (kernels/fp8_weight_matmul.py's
# MAX_TOKENS, repeated here so that this file imports no Triton).
WEIGHT_ONLY_MAX_TOKENS = 64


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [out, in] float -> (FP8 [out, in], fp32 scale [out]) with weight ~= fp8 * scale[:, None].

    Each output channel's absmax maps to FP8_MAX; an all-zero row gets scale 1 (its zeros are exact)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight takes an [out, in] matrix, got shape {tuple(weight.shape)}")
    if not weight.dtype.is_floating_point or weight.dtype == FP8_DTYPE:
        raise ValueError(f"quantize_weight takes a float32/bfloat16/float16 weight, got {weight.dtype}")
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight: [out, in] FP8; scale: [out] fp32 -> [out, in] fp32."""
    return weight.float() * scale[:, None]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, in] float -> (FP8 [T, in], fp32 scale [T, 1]): each row's absmax maps to FP8_MAX.

    Three kernels on a GPU (row absmax, divide, cast), since this runs before every FP8 matmul.
    No clamp is needed: |x| / (absmax / 448) exceeds 448 by fp32 rounding at most, and e4m3
    rounds anything below 464 to 448."""
    absmax = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    scale = absmax.clamp(min=_MIN_ABSMAX) / FP8_MAX
    return torch.div(x, scale).to(FP8_DTYPE), scale


def fp8_matmul_twin(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch twin of the scaled FP8 product, in fp32.

    x_fp8: [T, in] FP8; x_scale: [T, 1] fp32; weight: [out, in] FP8; weight_scale: [out] fp32;
    bias: [out] or None -> [T, out] out_dtype."""
    y = (x_fp8.float() * x_scale) @ dequantize_weight(weight, weight_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_matmul_cuda(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The same product on the tensor cores: ``torch._scaled_mm`` with row-wise scales.

    Shapes as ``fp8_matmul_twin``; in and out must be multiples of 16 (``check_fp8_shape``), T
    need not be. ``weight.t()`` is the column-major [in, out] operand _scaled_mm wants, without a
    copy. _scaled_mm refuses a bias with an fp32 output, so an fp32 model adds it after."""
    fused_bias = bias if out_dtype != torch.float32 else None
    y = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                         bias=fused_bias, out_dtype=out_dtype)
    if bias is not None and fused_bias is None:
        y = y + bias
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype) -> torch.Tensor:
    """x: [T, in]; weight: [out, in] FP8; weight_scale: [out] fp32; bias: [out] or None -> [T, out] out_dtype.

    Up to ``WEIGHT_ONLY_MAX_TOKENS`` tokens (decode) the step is bound by reading the weight: the
    activations stay as they are and only the weight is FP8 (kernels/fp8_weight_matmul.py on
    CUDA, its twin elsewhere). Above, activations are quantized per token here, every call
    (dynamic scales, nothing calibrated), for the FP8 tensor cores."""
    if x.shape[0] <= WEIGHT_ONLY_MAX_TOKENS:
        if x.is_cuda:
            from pagefleet.kernels.fp8_weight_matmul import fp8_weight_matmul  # imports triton: on first use

            return fp8_weight_matmul(x, weight, weight_scale, bias, out_dtype)
        return reference.fp8_weight_matmul(x, weight, weight_scale, bias, out_dtype)
    x_fp8, x_scale = quantize_per_token(x)
    if x.is_cuda and scaled_mm_supported(x.device):
        return fp8_matmul_cuda(x_fp8, x_scale, weight, weight_scale, bias, out_dtype)
    return fp8_matmul_twin(x_fp8, x_scale, weight, weight_scale, bias, out_dtype)


@functools.cache
def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores (CUDA, compute capability 8.9+); asked once per device."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def check_fp8_device(device: torch.device | str, capability: tuple[int, int] | None = None,
                     name: str | None = None) -> None:
    """Raise ValueError where FP8 weights cannot run: a CUDA GPU below compute capability 8.9.
    A CPU runs the twin. ``capability`` and ``name`` default to the device's own."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        name = name or torch.cuda.get_device_name(device)
        raise ValueError(f"FP8 weights need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ "
                         f"(Ada/Hopper); this GPU is {name} (compute capability {capability[0]}.{capability[1]})")


def check_fp8_shape(weight: torch.Tensor) -> None:
    """weight: [out, in] of a linear about to run in FP8 on CUDA: both dimensions multiples of 16,
    as torch._scaled_mm needs (every supported model's are; a tiny test model's may not be)."""
    if weight.is_cuda and any(d % _SCALED_MM_ALIGN for d in weight.shape):
        raise ValueError(f"FP8 weights on CUDA need in and out features in multiples of {_SCALED_MM_ALIGN}; "
                         f"a linear layer here is [out, in] = {list(weight.shape)} on this rank")
