"""The CPU engine's compiled kernel table: the PyTorch twins with its C++ kernels in their place.

The fused norms and rotary (fused_ops.py) replace the twins' ops; the decode attention
(decode_attention.py) plans each step's decode rows once its KV cache is allocated and reads
them in place, leaving prompts and prefill chunks to the twin.
"""

from __future__ import annotations

import dataclasses

from pagefleet.kernels.cpu import decode_attention as cpu_decode_attention
from pagefleet.kernels.cpu.fused_ops import with_fused_ops
from pagefleet.kernels.ops import Kernels

# How the start-up log names what this table compiled ("kernels on cpu: torch with ...").
COMPILED = "the C++ decode attention, norms and rotary"
COMPILED_WITHOUT_ATTENTION = "the C++ norms and rotary"


def compiled_cpu_kernels(twins: Kernels, *, decode_attention: bool = True) -> Kernels:
    """``twins`` (the PyTorch twins) with the C++ kernels in place; builds the fused ops' library
    now (the decode attention's waits for the KV cache's shape). ``decode_attention`` False keeps
    the twin's attention (an fp8 KV cache, which the C++ kernel does not read)."""
    if twins.backend != "torch":
        raise ValueError(f"the CPU engine's C++ kernels replace the PyTorch twins, not {twins.backend!r} kernels")
    fused = with_fused_ops(twins)
    if not decode_attention:
        return dataclasses.replace(fused, compiled=COMPILED_WITHOUT_ATTENTION)
    return dataclasses.replace(fused, paged_attention=cpu_decode_attention.paged_attention,
                               attention_planner=cpu_decode_attention.decode_attention_planner, compiled=COMPILED)
