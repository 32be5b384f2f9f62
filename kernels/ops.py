"""The one place that decides which implementation of each kernel runs.

``select_kernels(device)`` decides once, when an engine starts: CUDA runs the
Triton kernels, anything else runs the PyTorch twins in `reference.py`.
`PAGEFLEET_KERNELS=triton|torch` overrides that (`auto`, or unset, keeps the
per-device choice); Triton on a CPU tensor runs under Triton's interpreter. The
model calls the chosen ``Kernels``; nothing is looked up per call.

Attention may take a per-step plan, as vLLM's attention backends build their metadata
once a step: ``attention_planner(spec)`` gives the step's planner once the KV cache is
allocated, the runner calls it once a step, and every layer hands its plan to
``paged_attention``. The twins and the Triton kernels plan nothing (their plan is None);
a platform's own table (the CPU engine's compiled kernels, kernels/cpu/backend.py) may.

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
class AttentionSpec:
    """The attention shape a step's plan is made for (one rank's heads), known once the KV cache is."""

    dtype: torch.dtype  # of the KV cache (the query's, or float8_e4m3fn)
    num_heads: int      # query heads
    num_kv_heads: int
    head_dim: int
    block_size: int


# A step's planner: (block_table [B, W] int32, seq_lens [B] int32, query_start_loc as B + 1 ints,
# seq_lens as B ints) -> the step's plan (opaque: only the same table's paged_attention reads it),
# or None where this step needs none.
AttentionPlanner = Callable[[torch.Tensor, torch.Tensor, list[int], list[int]], object | None]


def no_plan(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: list[int],
            lens: list[int]) -> None:
    """The planner of a backend that plans nothing."""
    return None


def no_attention_planner(spec: AttentionSpec) -> AttentionPlanner:
    return no_plan


@dataclass(frozen=True, slots=True)
class Kernels:
    """One implementation of every kernel; shapes as in ``reference.py``'s twins."""

    backend: str  # "triton" | "torch"
    rms_norm: Callable            # (x [..., H], weight [H], eps) -> [..., H]
    fused_add_rms_norm: Callable  # (x, residual [..., H], weight, eps) -> (norm(x + residual), x + residual)
    silu_and_mul: Callable        # (x [..., 2*I]: gate | up) -> [..., I]
    rotary_embedding: Callable    # (positions [T], q [T, Hq, D], k [T, Hkv, D], cos_sin [P, D]) -> (q, k)
    write_kv_cache: Callable      # (k, v [T, Hkv, D], key_cache, value_cache [N, bs, Hkv, D], slots [T],
    #                                *, k_scale, v_scale) -> None
    paged_attention: Callable     # (q [T, Hq, D], caches, block_table [B, W], query_start_loc [B+1],
    #                                seq_lens [B], scale, *, k_scale, v_scale, sliding_window, sinks, plan)
    #                                -> [T, Hq, D]; sliding_window None or W: keys p - W + 1 .. p;
    #                                sinks None or [Hq] fp32 (gpt-oss's sink logits)
    fused_moe: Callable           # (x [T, H], w13 [E, 2*I, H], w2 [E, H, I], topk_weights [T, K],
    #                                topk_ids [T, K], *, w13_bias, w2_bias, swiglu_limit, swiglu_alpha)
    #                                -> [T, H]; biases and the clamped SwiGLU for gpt-oss
    # Caches hold the query's dtype or float8_e4m3fn (K / k_scale, V / v_scale); see reference.py.
    attention_planner: Callable[[AttentionSpec], AttentionPlanner] = no_attention_planner
    # Kernels compiled for this machine in place of the backend's own, as the start-up log names
    # them ("" where there are none).
    compiled: str = ""

    def __str__(self) -> str:
        return f"{self.backend} with {self.compiled}" if self.compiled else self.backend


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
        # Imported on first use: importing triton is slow, and it may be absent.
        from pagefleet.kernels import activation, kv_cache_write, paged_attention, rms_norm, rotary

        impl = SimpleNamespace(
            rms_norm=rms_norm.rms_norm,
            fused_add_rms_norm=rms_norm.fused_add_rms_norm,
            silu_and_mul=activation.silu_and_mul,
            rotary_embedding=rotary.rotary_embedding,
            write_kv_cache=kv_cache_write.write_kv_cache,
            paged_attention=paged_attention.paged_attention,
            # No Triton MoE kernel yet: the twin runs on the device (it reads each layer's
            # expert counts on the host, so MoE models run without CUDA graphs).
            fused_moe=reference.fused_moe,
        )
    return Kernels(backend=backend, **{name: getattr(impl, name) for name in _KERNEL_NAMES})


_KERNEL_NAMES = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache",
                 "paged_attention", "fused_moe")
