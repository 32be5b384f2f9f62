"""The one place that decides which implementation of each kernel runs.

Per call, from the device of the first tensor argument: CUDA runs the Triton
kernels, anything else runs the PyTorch twins in `reference.py`.
`PAGEFLEET_KERNELS=triton|torch` overrides that (`auto`, or unset, keeps the
per-device choice); Triton on a CPU tensor runs under Triton's interpreter.

Triton is imported only when a Triton kernel is first chosen, so this module
imports (and the twins work) where Triton is not installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace

import torch

from pagefleet.kernels import reference
from pagefleet.kernels.reference import build_cos_sin_cache  # noqa: F401  (host-side table, no kernel)

ENV_VAR = "PAGEFLEET_KERNELS"
_CHOICES = ("auto", "triton", "torch")


@functools.cache
def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # sys.modules["triton"] is None: imports of it are blocked
        return False


def backend_for(x: torch.Tensor) -> str:
    """'triton' or 'torch': the implementation that runs for a tensor on x's device."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not one of {', '.join(_CHOICES)}")
    if choice == "auto":
        return "triton" if x.is_cuda and _triton_installed() else "torch"
    if choice == "triton" and not _triton_installed():
        raise RuntimeError(f"{ENV_VAR}=triton but the triton package is not installed")
    return choice


@functools.cache
def _triton() -> SimpleNamespace:
    # Imported on first use: importing triton costs about a second, and it may be absent.
    from pagefleet.kernels import activation, kv_cache_write, paged_attention, rms_norm, rotary
    return SimpleNamespace(
        rms_norm=rms_norm.rms_norm,
        fused_add_rms_norm=rms_norm.fused_add_rms_norm,
        silu_and_mul=activation.silu_and_mul,
        rotary_embedding=rotary.rotary_embedding,
        write_kv_cache=kv_cache_write.write_kv_cache,
        paged_attention=paged_attention.paged_attention,
    )


def implementation(name: str, x: torch.Tensor):
    """The function that `ops.<name>` runs for a tensor like x (the Triton launcher or the twin)."""
    return getattr(_triton() if backend_for(x) == "triton" else reference, name)



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., H], weight: [H] -> [..., H]
    return implementation("rms_norm", x)(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [..., H] -> (rms_norm(x + residual), x + residual); inputs untouched
    return implementation("fused_add_rms_norm", x)(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2*I] (gate | up) -> [..., I]
    return implementation("silu_and_mul", x)(x)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [T]; query: [T, Hq, D], key: [T, Hkv, D], rotated in place; cos_sin_cache: [P, D] fp32
    return implementation("rotary_embedding", query)(positions, query, key, cos_sin_cache)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # key, value: [T, Hkv, D]; key_cache, value_cache: [N, bs, Hkv, D]; slot_mapping: [T] (< 0: skip)
    return implementation("write_kv_cache", key)(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    # query: [T, Hq, D]; caches: [N, bs, Hkv, D]; block_table: [B, max_blocks];
    # query_start_loc: [B + 1]; seq_lens: [B] -> [T, Hq, D]
    return implementation("paged_attention", query)(query, key_cache, value_cache, block_table, query_start_loc,
                                           seq_lens, scale)
