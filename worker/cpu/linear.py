"""Linear layers on CPU through oneDNN with weights packed once at load, as vLLM's CPU backend does.

``F.linear`` hands an fp32 weight to the BLAS as it lies ([out, in], row-major), and the
BLAS re-blocks it on every call; oneDNN's matmul on a weight reordered once into its own
blocked layout skips that. One row (a matrix-vector product, all of a single stream's
decode) streams the weight once and is memory-bound, and which path streams it fastest
depends on the CPU (the BLAS's gemv, the packed copy, or the engine's own C++ product in
kernels/cpu/fused_ops.py when the engine compiles its kernels). So which one serves one-row
inputs is timed at load, over the model's own weights (``choose_one_row_path``). The plain
weight stays either way (the packed copy is extra memory, the size of the linear weights).
Figures in docs/cpu_engine.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.kernels.cpu import fused_ops as cpu_fused_ops

logger = logging.getLogger(__name__)

# The row count oneDNN tunes the packed layout for (vLLM's CPU backend uses 32 too); any
# row count runs on it, this one fastest.
PACK_FOR_ROWS = 32
# The one-row measurement streams at least this many weight bytes per pass (when the model
# has them), so that it times memory as a step does, not caches; and at most a little more.
ONE_ROW_SAMPLE_BYTES = 256 << 20
ONE_ROW_ROUNDS = 3


# What can serve one-row inputs: F.linear on the plain weight, oneDNN on the packed copy, the
# engine's C++ matrix-vector product on the plain weight (fp32, compiled kernels only).
ONE_ROW_PATHS = ("plain", "packed", "gemv")


@dataclass(slots=True)
class PackedWeight:
    weight: torch.Tensor  # oneDNN's blocked copy of an [out, in] weight
    one_row: str = "plain"  # the ONE_ROW_PATHS entry that serves one-row inputs (measured at load)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """weight: [out, in] on CPU -> its oneDNN-packed copy, or None where oneDNN cannot take it."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not onednn_available():
        return None
    try:
        with torch.inference_mode():
            return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS))
    except RuntimeError as e:  # a build or CPU without the kernel: the plain weight serves
        logger.warning("oneDNN cannot pack a %s weight (%s); using F.linear", tuple(weight.shape), e)
        return None


@dataclass(slots=True)
class PackedExperts:
    """A mixture of experts' weights (``moe.FusedExperts``' w13 and w2), each expert's packed
    for oneDNN: ``kernels.reference.fused_moe`` runs each expert's two products on them."""

    w13: list[torch.Tensor]  # per expert: [2*I, H] (gate | up), packed
    w2: list[torch.Tensor]  # per expert: [H, I], packed

    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.w13[expert], None, "none", [], "")

    def down(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.w2[expert], None, "none", [], "")


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts | None:
    """w13: [E, 2*I, H]; w2: [E, H, I] -> every expert's packed copies, or None where oneDNN
    cannot take them."""
    packed = [pack_weight(w) for w in (*w13, *w2)]
    if any(p is None for p in packed):
        return None
    num_experts = w13.shape[0]
    return PackedExperts([p.weight for p in packed[:num_experts]], [p.weight for p in packed[num_experts:]])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    # x: [M, in]; weight: [out, in]; packed: pack_weight(weight) or None -> [M, out]
    if x.shape[0] == 1 and packed is not None and packed.one_row != "packed":
        return cpu_fused_ops.gemv(x, weight, bias) if packed.one_row == "gemv" else F.linear(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.weight, bias, "none", [], "")


@dataclass(slots=True)
class OneRowTiming:
    ms: dict[str, float]  # best pass over the sample, per ONE_ROW_PATHS entry measured
    sample_bytes: int

    @property
    def best(self) -> str:
        return min(self.ms, key=self.ms.get)


@torch.inference_mode()
def choose_one_row_path(modules: list[nn.Module], paths: tuple[str, ...]) -> OneRowTiming:
    """Time one-row products through each of ``paths`` (``linear`` itself, with the path set on
    every packed weight), alternately, over the modules' weights in order (at least
    ONE_ROW_SAMPLE_BYTES of them, or all)."""
    sample, size = [], 0
    for m in modules:
        if size >= ONE_ROW_SAMPLE_BYTES:
            break
        sample.append((m.weight, m.packed_weight, torch.randn(1, m.weight.shape[1], dtype=m.weight.dtype)))
        size += m.weight.numel() * m.weight.element_size()

    times: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(ONE_ROW_ROUNDS + 1):  # the first round warms every path up and is not counted
        for path, seen in times.items():
            for _, packed, _ in sample:
                packed.one_row = path
            start = time.perf_counter()
            for weight, packed, x in sample:
                linear(x, weight, None, packed)
            seen.append(time.perf_counter() - start)
    return OneRowTiming({path: min(seen[1:]) * 1e3 for path, seen in times.items()}, size)


def pack_linear_weights(model: nn.Module, compiled_kernels: bool = False) -> tuple[int, OneRowTiming | None]:
    """Give every module with a ``packed_weight`` slot its packed weight, and let the fastest
    one-row path measured serve one-row inputs (the C++ one only with ``compiled_kernels`` and
    fp32 weights). Returns how many were packed and the measurement (None without packed
    weights). FP8 linears (those with a ``weight_scale``) are left alone: fp8.fp8_linear runs them."""
    for m in model.modules():
        if hasattr(m, "packed_experts"):  # mixtures of experts: the products' bulk (measured: 2x on 2 cores)
            m.packed_experts = pack_experts(m.w13, m.w2)
    modules = [m for m in model.modules()
               if hasattr(m, "packed_weight") and getattr(m, "weight_scale", None) is None]
    for m in modules:
        m.packed_weight = pack_weight(m.weight)
    packed = [m for m in modules if m.packed_weight is not None]
    if not packed:
        return 0, None
    fp32 = all(m.weight.dtype == torch.float32 and m.weight.is_contiguous() for m in packed)
    timing = choose_one_row_path(packed, ONE_ROW_PATHS if compiled_kernels and fp32 else ONE_ROW_PATHS[:2])
    for m in packed:
        m.packed_weight.one_row = timing.best
    return len(packed), timing
