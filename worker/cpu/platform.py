"""The CPU platform: what a CPU engine sets up around the generic model runner, at start.

The allocator keeps freed memory (malloc.py); the kernels are the PyTorch twins with the C++
kernels in their place unless ``enforce_eager`` (kernels/cpu/backend.py); the linear weights
are packed for oneDNN and the fastest one-row path is timed over them (linear.py); a one-rank
engine computes on every core unless ``cpu_omp_threads`` says otherwise, and a served engine's
step thread takes the lowest priority and pins its OpenMP team before the engine is built on
it (threads.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagefleet.kernels.cpu.backend import compiled_cpu_kernels
from pagefleet.kernels.ops import Kernels, select_kernels
from pagefleet.worker.cpu.linear import pack_linear_weights
from pagefleet.worker.cpu.malloc import keep_freed_memory
from pagefleet.worker.cpu.threads import available_cores, cpu_compute_threads, prepare_engine_thread

if TYPE_CHECKING:
    from pagefleet.worker.engine_args import EngineArgs

# The model runner's logger: these start-up lines are part of building the model runner.
logger = logging.getLogger("pagefleet.worker.model_executor.model_runner")


def cpu_threads_of(args: EngineArgs) -> int | None:
    """The torch thread count a one-rank CPU engine computes with (None: a tensor-parallel
    engine, whose ranks keep torch's own)."""
    if args.tensor_parallel_size != 1:
        return None
    return cpu_compute_threads(args.cpu_omp_threads, available_cores())


class CpuPlatform:
    def prepare_process(self) -> None:
        keep_freed_memory()

    def select_kernels(self, device: torch.device, enforce_eager: bool,
                       kv_cache_dtype: torch.dtype | None = None) -> Kernels:
        kernels = select_kernels(device)
        # Only where the twins would run: the Triton kernels (PAGEFLEET_KERNELS=triton) already
        # read the blocks in place and fuse these ops.
        if enforce_eager or kernels.backend != "torch":
            return kernels
        fp8_kv_cache = kv_cache_dtype == torch.float8_e4m3fn
        if fp8_kv_cache:
            logger.info("fp8 KV cache: attention runs in the PyTorch twin (the C++ decode attention reads "
                        "16- and 32-bit blocks only)")
        return compiled_cpu_kernels(kernels, decode_attention=not fp8_kv_cache)

    def prepare_model(self, model: nn.Module, kernels: Kernels) -> None:
        count, one_row = pack_linear_weights(model, compiled_kernels=bool(kernels.compiled))
        logger.info("linear layers: %d weights packed for oneDNN%s", count, "" if one_row is None else
                    f"; one-row steps take the {one_row.best} path (one-row pass over "
                    f"{one_row.sample_bytes >> 20} MiB of weights: "
                    + ", ".join(f"{path} {ms:.1f} ms" for path, ms in one_row.ms.items()) + ")")

    def set_compute_threads(self, args: EngineArgs) -> None:
        threads = cpu_threads_of(args)
        if threads is not None:
            torch.set_num_threads(threads)

    def prepare_step_thread(self, args: EngineArgs) -> tuple[EngineArgs, dict[int, int]]:
        """Lowest priority, OpenMP team started and pinned (``threads.prepare_engine_thread``), and
        a one-rank engine's torch thread count (``cpu_threads_of``) filled into ``args``. The count
        is taken first, on the process's cores: after the pinning this thread may use one core,
        and the executor, built next on it, would compute on one thread."""
        threads = cpu_threads_of(args)
        if threads is not None:
            args = dataclasses.replace(args, cpu_omp_threads=threads)
        return args, prepare_engine_thread(threads)
