"""How the engine runs its model: an ``Executor`` over one or more ranks.

The engine speaks only this protocol. ``UniProcExecutor`` is the single rank in
the engine's own process (tensor_parallel_size 1, or a simulated GPU of any size);
``TPExecutor`` (tp_executor.py) drives Ray actors for ranks 1..N-1 beside rank 0.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.lora.request import LoRAConfig, LoRARequest
from pagefleet.worker.model_executor.model_config import ModelConfig
from pagefleet.worker.model_executor.model_runner import ModelRunner, StepInput
from pagefleet.worker.model_executor.platform import platform_for
from pagefleet.worker.model_executor.simulated_runner import SimulatedModelRunner
from pagefleet.worker.parallel.tp_group import SINGLE


class Executor(Protocol):
    def kv_bytes_per_block(self, block_size: int) -> int:
        """KV bytes one block takes on each rank."""

    def available_kv_bytes(self, kv_cache_bytes: int | None, gpu_memory_utilization: float | None,
                           max_num_batched_tokens: int) -> int:
        """The KV budget per rank (the smallest over ranks)."""

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    # Whether execute takes prev_tokens (ModelRunner.execute): every rank must read the same
    # device tensor, so only an executor of one rank can.
    reads_device_tokens: bool

    def execute(self, step: StepInput, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward one step on every rank; the sampling rows' fp32 logits [S, vocab]."""

    def add_lora(self, request: LoRARequest) -> None:
        """Register and load a LoRA adapter on every rank (a ValueError names what is wrong with it)."""

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget a LoRA adapter on every rank (its GPU slot and host copy)."""

    def check_health(self) -> None:
        """Raise if a rank died or hung, even while the engine is idle."""

    def shutdown(self) -> None:
        """Release every rank (and its memory); the executor is unusable afterwards."""


class UniProcExecutor:
    """One rank, in this process: failures surface as exceptions from ``execute`` itself."""

    def __init__(self, runner: ModelRunner | SimulatedModelRunner) -> None:
        self.runner: ModelRunner | SimulatedModelRunner | None = runner

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self._runner().kv_bytes_per_block(block_size)

    def available_kv_bytes(self, kv_cache_bytes: int | None, gpu_memory_utilization: float | None,
                           max_num_batched_tokens: int) -> int:
        return self._runner().available_kv_bytes(kv_cache_bytes, gpu_memory_utilization, max_num_batched_tokens)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._runner().allocate_kv_cache(num_blocks, block_size)

    # Every step runs in this process, so a step can read the previous one's tokens on the device.
    reads_device_tokens = True

    def execute(self, step: StepInput, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        return self._runner().execute(step, prev_tokens)

    def add_lora(self, request: LoRARequest) -> None:
        runner = self._runner()
        if isinstance(runner, ModelRunner):
            runner.add_lora(request)
        # the simulated GPU computes nothing: an adapter changes no step's time there

    def remove_lora(self, lora_int_id: int) -> None:
        runner = self._runner()
        if isinstance(runner, ModelRunner):
            runner.remove_lora(lora_int_id)

    def decode_greedy(self, steps: list[StepInput]):
        """Several greedy decode steps in one go (``ModelRunner.decode_greedy``); None where the
        runner cannot. One rank only: a tensor-parallel executor has no such method."""
        runner = self._runner()
        return runner.decode_greedy(steps) if isinstance(runner, ModelRunner) else None

    def check_health(self) -> None:
        self._runner()  # no other process to lose: only a shut-down executor is unhealthy

    def shutdown(self) -> None:
        # Drop the weights and KV cache now rather than when the engine is collected, so a new
        # engine in this process (or on this GPU) gets the memory back.
        self.runner = None

    def _runner(self) -> ModelRunner | SimulatedModelRunner:
        if self.runner is None:
            raise RuntimeError("the executor is shut down")
        return self.runner


def make_executor(cfg: ModelConfig, args: EngineArgs, device: torch.device) -> Executor:
    if args.simulate is not None:
        # The simulated GPU computes nothing: one runner stands for every rank of the replica.
        return UniProcExecutor(SimulatedModelRunner(cfg, args))
    if args.tensor_parallel_size == 1:
        platform_for(device).set_compute_threads(args)
        return UniProcExecutor(ModelRunner(cfg, SINGLE, device, args.load_format, args.seed, args.enforce_eager,
                                           args.max_num_seqs, args.max_num_batched_tokens,
                                           kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                                           lora=LoRAConfig.of(args)))
    from pagefleet.worker.parallel.tp_executor import TPExecutor

    return TPExecutor(cfg, args, device)

