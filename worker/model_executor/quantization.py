"""Which quantization an engine runs, and putting it on the model's linear layers at load.

``--quantization fp8`` quantizes a full-precision checkpoint's linear weights as they load; a
checkpoint already in FP8 (compressed-tensors, compressed_tensors.py) runs FP8 with or without
the flag and loads its weights as they are. The embeddings and lm_head stay in full precision,
as vLLM keeps them.
"""

from __future__ import annotations

import torch
from torch import nn

from pagefleet.worker.model_executor.fp8 import check_fp8_device
from pagefleet.worker.model_executor.layers import QuantizableLinear
from pagefleet.worker.model_executor.model_config import QUANTIZATIONS, ModelConfig


def resolve_quantization(requested: str | None, cfg: ModelConfig, device: torch.device | str) -> str | None:
    """The quantization the engine runs: ``requested`` (``--quantization``) or the checkpoint's own.
    Raises ValueError, before any weight loads, for an unknown name or a GPU without FP8."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {requested!r}; supported: {', '.join(QUANTIZATIONS)}")
    quantization = requested or cfg.quantization
    if quantization == "fp8":
        check_fp8_device(device)
    return quantization


def fp8_linears(model: nn.Module) -> list[QuantizableLinear]:
    """The linear layers FP8 applies to (q|k|v, o, gate|up, down of every layer; not lm_head)."""
    return [m for m in model.modules() if isinstance(m, QuantizableLinear)]


def hold_fp8_checkpoint(model: nn.Module) -> None:
    """Before a pre-quantized checkpoint loads: every linear holds FP8 weights and their scales."""
    for linear in fp8_linears(model):
        linear.hold_fp8_checkpoint()


def quantize_fp8(model: nn.Module) -> None:
    """After full-precision weights load: every linear quantized, its full-precision weight freed."""
    for linear in fp8_linears(model):
        if linear.weight_scale is None:
            linear.quantize_fp8()


# The sixteen values of an FP4 (e2m1) code, by its 4 bits: sign, then two exponent and one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 as gpt-oss's checkpoints store it, in full precision: blocks [..., G, 16] uint8 hold
    32 FP4 codes per group (the low nibble first), scales [..., G] uint8 one E8M0 exponent per
    group (2 ** (scale - 127)). Returns [..., G * 32] in ``dtype``: exact (every value is a
    code times a power of two)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
                         "need blocks [..., G, 16] and scales [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return out.flatten(-2).to(dtype)
