"""Linear layers on CPU through oneDNN with weights packed once at load, as vLLM's CPU backend does.

``F.linear`` hands an fp32 weight to the BLAS as it lies ([out, in], row-major), and the
BLAS re-blocks it on every call; oneDNN's matmul on a weight reordered once into its own
blocked layout skips that. Measured on this project's 2-core machines, the demo model's
eight layers plus its LM head in a row (weights cold in cache): 30-50% faster at 8-64
rows, ~10% at 128-512. One row (a matrix-vector product, all of a single stream's
decode) depends on the CPU: on an Intel Xeon the BLAS's gemv, streaming the plain
weight, beat the packed copy; on an AMD EPYC it streamed at 8-9 GB/s where the packed
copy reached 11-17 GB/s (the LM head 7.1 -> 3.9 ms). So which one serves one-row inputs
is measured at load, over the model's own weights (``prefer_packed_for_one_row``). The
plain weight stays either way (the packed copy is extra memory, the size of the linear
weights).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# The row count oneDNN tunes the packed layout for (vLLM's CPU backend uses 32 too); any
# row count runs on it, this one fastest.
PACK_FOR_ROWS = 32
# The one-row measurement streams at least this many weight bytes per pass (when the model
# has them), so that it times memory as a step does, not caches; and at most a little more.
ONE_ROW_SAMPLE_BYTES = 256 << 20
ONE_ROW_ROUNDS = 3


@dataclass(slots=True)
class PackedWeight:
    weight: torch.Tensor  # oneDNN's blocked copy of an [out, in] weight
    one_row: bool = False  # serves one-row inputs too (measured faster than F.linear at load)


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    # x: [M, in]; weight: [out, in]; packed: pack_weight(weight) or None -> [M, out]
    if packed is None or (x.shape[0] == 1 and not packed.one_row):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.weight, bias, "none", [], "")


@dataclass(slots=True)
class OneRowTiming:
    plain_ms: float   # best pass of F.linear over the sample
    packed_ms: float  # best pass of the packed copies over the same sample
    sample_bytes: int

    @property
    def packed_wins(self) -> bool:
        return self.packed_ms < self.plain_ms


@torch.inference_mode()
def prefer_packed_for_one_row(modules: list[nn.Module]) -> OneRowTiming:
    """Time one-row products through F.linear and through the packed copies, alternately,
    over the modules' weights in order (at least ONE_ROW_SAMPLE_BYTES of them, or all)."""
    sample, size = [], 0
    for m in modules:
        if size >= ONE_ROW_SAMPLE_BYTES:
            break
        sample.append((m.weight, m.packed_weight.weight, torch.randn(1, m.weight.shape[1], dtype=m.weight.dtype)))
        size += m.weight.numel() * m.weight.element_size()

    def plain() -> None:
        for weight, _, x in sample:
            F.linear(x, weight)

    def onednn() -> None:
        for _, packed, x in sample:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    times: dict = {plain: [], onednn: []}
    for _ in range(ONE_ROW_ROUNDS + 1):  # the first round warms both up and is not counted
        for run, seen in times.items():
            start = time.perf_counter()
            run()
            seen.append(time.perf_counter() - start)
    return OneRowTiming(min(times[plain][1:]) * 1e3, min(times[onednn][1:]) * 1e3, size)


def pack_linear_weights(model: nn.Module) -> tuple[int, OneRowTiming | None]:
    """Give every module with a ``packed_weight`` slot its packed weight, and let the packed
    copies serve one-row inputs where they are measured faster. Returns how many were packed
    and the measurement (None without packed weights)."""
    modules = [m for m in model.modules() if hasattr(m, "packed_weight")]
    for m in modules:
        m.packed_weight = pack_weight(m.weight)
    packed = [m for m in modules if m.packed_weight is not None]
    if not packed:
        return 0, None
    timing = prefer_packed_for_one_row(packed)
    for m in packed:
        m.packed_weight.one_row = timing.packed_wins
    return len(packed), timing
