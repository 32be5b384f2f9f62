"""The platform an engine runs on: the set-up its device needs around the generic model runner.

The model runner, the executor and a served engine's step thread ask the platform of their
device (``platform_for``, CPU or CUDA) for what only that device needs, once, at start; each
step then runs the same code on either. The CPU platform is worker/cpu/platform.py. CUDA needs
nothing beyond its kernel table: its Triton kernels read the paged cache in place and plan
nothing, and torch's defaults serve its host threads and memory. A simulated GPU
(``EngineArgs.simulate``, ``platform_of``) needs nothing at all: its engine computes nothing on
the host, so it pins no thread and lowers no priority.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from pagefleet.kernels.ops import Kernels, select_kernels
from pagefleet.worker.cpu.platform import CpuPlatform
from pagefleet.worker.engine_args import EngineArgs


class Platform(Protocol):
    def prepare_process(self) -> None:
        """Process-wide settings, before the model loads."""

    def select_kernels(self, device: torch.device, enforce_eager: bool,
                       kv_cache_dtype: torch.dtype | None = None) -> Kernels:
        """The kernel table an engine on ``device`` runs (``PAGEFLEET_KERNELS`` honoured), decided
        once; ``enforce_eager`` keeps the platform from compiling kernels of its own, and
        ``kv_cache_dtype`` (None: the model's) from using ones that cannot read that cache."""

    def prepare_model(self, model: nn.Module, kernels: Kernels) -> None:
        """What is done once to the loaded weights."""

    def set_compute_threads(self, args: EngineArgs) -> None:
        """The host threads a one-rank engine in this process computes with (its executor, at start)."""

    def prepare_step_thread(self, args: EngineArgs) -> tuple[EngineArgs, dict[int, int]]:
        """Make the calling thread the step thread of the engine about to be built on it. Returns
        ``args`` as that engine must take them, and the threads pinned (thread id -> core)."""


class CudaPlatform:
    def prepare_process(self) -> None:
        return None

    def select_kernels(self, device: torch.device, enforce_eager: bool,
                       kv_cache_dtype: torch.dtype | None = None) -> Kernels:
        return select_kernels(device)

    def prepare_model(self, model: nn.Module, kernels: Kernels) -> None:
        return None

    def set_compute_threads(self, args: EngineArgs) -> None:
        return None

    def prepare_step_thread(self, args: EngineArgs) -> tuple[EngineArgs, dict[int, int]]:
        return args, {}


class SimulatedPlatform(CudaPlatform):
    """A simulated GPU: as CUDA, nothing to set up on the host (no kernels run)."""


_CPU, _CUDA, _SIMULATED = CpuPlatform(), CudaPlatform(), SimulatedPlatform()


def platform_for(device: torch.device | str) -> Platform:
    """The CPU platform for a CPU device, else CUDA's."""
    return _CPU if torch.device(device).type == "cpu" else _CUDA


def platform_of(args: EngineArgs, device: torch.device | str) -> Platform:
    """The platform of an engine with ``args`` on ``device``: a simulated GPU's under ``args.simulate``."""
    return _SIMULATED if args.simulate is not None else platform_for(device)
