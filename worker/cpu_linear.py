"""Linear layers on CPU through oneDNN with weights packed once at load, as vLLM's CPU backend does.

``F.linear`` hands an fp32 weight to the BLAS as it lies ([out, in], row-major), and the
BLAS re-blocks it on every call; oneDNN's matmul on a weight reordered once into its own
blocked layout skips that. Measured on this project's 2-core AVX-512 machine, one thread,
the demo model's eight layers plus its LM head in a row (weights cold in cache): 30-50%
faster at 8-64 rows, ~10% at 128-512, but slower for one row (a matrix-vector product,
where the BLAS's gemv streams the plain weight at memory speed). So one row takes
``F.linear`` on the plain weight, which therefore stays; the packed copy is extra memory
(the size of the linear weights).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# The row count oneDNN tunes the packed layout for (vLLM's CPU backend uses 32 too); any
# row count runs on it, this one fastest.
PACK_FOR_ROWS = 32


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight: [out, in] on CPU -> its oneDNN-packed copy, or None where oneDNN cannot take it."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not onednn_available():
        return None
    try:
        with torch.inference_mode():
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
    except RuntimeError as e:  # a build or CPU without the kernel: the plain weight serves
        logger.warning("oneDNN cannot pack a %s weight (%s); using F.linear", tuple(weight.shape), e)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    # x: [M, in]; weight: [out, in]; packed: pack_weight(weight) or None -> [M, out]
    if packed is None or x.shape[0] == 1:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Give every module with a ``packed_weight`` slot its packed weight; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            module.packed_weight = pack_weight(module.weight)
            count += module.packed_weight is not None
    return count
