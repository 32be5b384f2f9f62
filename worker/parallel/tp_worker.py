"""Tensor-parallel ranks 1..N-1: a ModelRunner that runs every step rank 0 broadcasts.

Plain Python; tp_executor.py wraps it as a Ray actor. Setup calls (join, load, size and
allocate the KV cache) arrive as Ray method calls; then ``run_loop`` takes the actor over
until rank 0 broadcasts stop.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

import torch

from pagefleet.worker.lora.request import LoRAConfig, LoRARequest
from pagefleet.worker.model_executor.model_config import ModelConfig
from pagefleet.worker.model_executor.model_runner import ModelRunner
from pagefleet.worker.parallel.distributed import ProcessGroups, destroy_process_groups, init_process_groups
from pagefleet.worker.parallel.step_wire import receive_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one rank's weight load cost."""

    rank: int
    weight_bytes: int          # bytes of this rank's parameters
    peak_rss_delta_bytes: int  # growth of the process's peak resident set across the load


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build_runner(cfg: ModelConfig, groups: ProcessGroups, device: torch.device, load_format: str,
                 seed: int, kv_cache_dtype: str = "auto", quantization: str | None = None,
                 lora: LoRAConfig | None = None) -> tuple[ModelRunner, LoadReport]:
    before = peak_rss_bytes()
    # Tensor-parallel ranks run eagerly: the compiled decode attention is wired and tested for
    # one-rank engines only.
    runner = ModelRunner(cfg, groups.tp, device, load_format, seed, enforce_eager=True,
                         kv_cache_dtype=kv_cache_dtype, quantization=quantization, lora=lora)
    return runner, LoadReport(groups.tp.rank, runner.weight_bytes(), peak_rss_bytes() - before)


class TPWorker:
    def __init__(self, cfg: ModelConfig, rank: int, world_size: int, device_type: str) -> None:
        if rank < 1:
            raise ValueError(f"TPWorker serves ranks 1..N-1, got rank {rank}")
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        # Ray has narrowed CUDA_VISIBLE_DEVICES to this actor's one GPU.
        self.device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        self.groups: ProcessGroups | None = None
        self.runner: ModelRunner | None = None

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def join(self, host: str, port: int, step_timeout_s: float, init_timeout_s: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.groups = init_process_groups(rank=self.rank, world_size=self.world_size, device=self.device,
                                          host=host, port=port, step_timeout_s=step_timeout_s,
                                          init_timeout_s=init_timeout_s)

    def load(self, load_format: str, seed: int, kv_cache_dtype: str = "auto",
             quantization: str | None = None, lora: LoRAConfig | None = None) -> LoadReport:
        torch.manual_seed(seed)
        self.runner, report = build_runner(self.cfg, self.groups, self.device, load_format, seed, kv_cache_dtype,
                                           quantization, lora)
        return report

    def available_kv_bytes(self, kv_cache_bytes: int | None, gpu_memory_utilization: float | None,
                           max_num_batched_tokens: int) -> int:
        # On CUDA this is a profile run with collectives: rank 0 runs its own at the same time.
        return self.runner.available_kv_bytes(kv_cache_bytes, gpu_memory_utilization, max_num_batched_tokens)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, block_size)

    def run_loop(self) -> int:
        """Execute broadcast steps (and register adapters) until rank 0 says stop; returns the
        number of steps run.
        On any error the groups are torn down first, so rank 0's pending collective fails
        at once (connection closed) instead of waiting out its timeout."""
        steps = 0
        try:
            while (message := receive_step(self.groups.control)) is not None:
                if isinstance(message, LoRARequest):
                    self.runner.add_lora(message)  # rank 0 read the same adapter without error
                    continue
                if isinstance(message, int):
                    self.runner.remove_lora(message)
                    continue
                self.runner.execute(message)
                steps += 1
        except BaseException:
            logger.exception("tensor-parallel rank %d failed after %d steps", self.rank, steps)
            destroy_process_groups(abort=True)
            raise
        destroy_process_groups()
        return steps
