"""The one place that decides which implementation of each kernel runs.

``select_kernels(device)`` decides once, when an engine starts: CUDA runs the
Triton kernels, anything else runs the PyTorch twins in `reference.py`.
`PAGEFLEET_KERNELS=triton|torch` overrides that (`auto`, or unset, keeps the
per-device choice); Triton on a CPU tensor runs under Triton's interpreter. The
model calls the chosen ``Kernels``; nothing is looked up per call.

Triton is imported only when the Triton kernels are chosen, so this module
imports (and the twins work) where Triton is not installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

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


@dataclass(frozen=True, slots=True)
class Kernels:
    """One implementation of every kernel; shapes as in ``reference.py``'s twins."""

    backend: str  # "triton" | "torch"
    rms_norm: Callable            # (x [..., H], weight [H], eps) -> [..., H]
    fused_add_rms_norm: Callable  # (x, residual [..., H], weight, eps) -> (norm(x + residual), x + residual)
    silu_and_mul: Callable        # (x [..., 2*I]: gate | up) -> [..., I]
    rotary_embedding: Callable    # (positions [T], q [T, Hq, D], k [T, Hkv, D], cos_sin [P, D]) -> (q, k)
    write_kv_cache: Callable      # (k, v [T, Hkv, D], key_cache, value_cache [N, bs, Hkv, D], slots [T]) -> None
    paged_attention: Callable     # (q [T, Hq, D], caches, block_table [B, W], query_start_loc [B+1],
    #                                seq_lens [B], scale) -> [T, Hq, D]


def choose_backend(device: torch.device | str) -> str:
    """'triton' or 'torch': what runs on ``device``, after ``PAGEFLEET_KERNELS``."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not one of {', '.join(_CHOICES)}")
    if choice == "auto":
        return "triton" if torch.device(device).type == "cuda" and _triton_installed() else "torch"
    if choice == "triton" and not _triton_installed():
        raise RuntimeError(f"{ENV_VAR}=triton but the triton package is not installed")
    return choice


def select_kernels(device: torch.device | str) -> Kernels:
    """The kernels an engine on ``device`` runs (decided once, at engine start)."""
    backend = choose_backend(device)
    if backend == "torch":
        impl = reference
    else:
        # Imported on first use: importing triton costs about a second, and it may be absent.
        from pagefleet.kernels import activation, kv_cache_write, paged_attention, rms_norm, rotary

        impl = SimpleNamespace(
            rms_norm=rms_norm.rms_norm,
            fused_add_rms_norm=rms_norm.fused_add_rms_norm,
            silu_and_mul=activation.silu_and_mul,
            rotary_embedding=rotary.rotary_embedding,
            write_kv_cache=kv_cache_write.write_kv_cache,
            paged_attention=paged_attention.paged_attention,
        )
    return Kernels(backend=backend, **{name: getattr(impl, name) for name in _KERNEL_NAMES})


_KERNEL_NAMES = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache",
                 "paged_attention")
