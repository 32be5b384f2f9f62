"""A simulated GPU in the model runner's place (``EngineArgs.simulate``): no weights and no KV
tensors; a step waits the time the roofline gives its batch on that GPU, divided by
``simulate_efficiency``. The pool is the one the engine would size for that GPU's memory.

Both come from ``worker/simulated/sizing.py``, which ``pagefleet plan`` builds on too, so the
simulator and the planner cannot disagree. The engine around this runner is the real one; the
sampler that stands in for the model's logits is ``simulated_sampler.py``.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.model_executor.model_config import ModelConfig
from pagefleet.worker.model_executor.model_runner import StepInput
from pagefleet.worker.simulated.roofline import StepRoofline, StepWork, step_work
from pagefleet.worker.simulated.sizing import simulated_replica, size_gpu, step_roofline

logger = logging.getLogger(__name__)


class SimulatedForward(NamedTuple):
    """A step queued on the simulated GPU: what the runner returns in place of logits."""

    ready_at: float  # time.perf_counter() when the GPU has finished it


class SimulatedModelRunner:
    def __init__(self, cfg: ModelConfig, args: EngineArgs) -> None:
        replica = simulated_replica(cfg, args)
        sizing = size_gpu(replica)
        self.gpu = replica.gpu
        self.kv_budget_bytes = sizing.kv_budget_bytes
        self.kv_bytes_per_token = sizing.kv_bytes_per_token
        self.roofline: StepRoofline = step_roofline(replica, sizing)
        self.efficiency = args.simulate_efficiency
        self.ready_at = 0.0  # when the simulated GPU finishes what is queued on it
        logger.info("simulated %s (%d GPU(s) per replica): steps at %g of the roofline", self.gpu.name,
                    args.tensor_parallel_size, self.efficiency)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token

    def available_kv_bytes(self, kv_cache_bytes: int | None, gpu_memory_utilization: float | None,
                           max_num_batched_tokens: int) -> int:
        """The sized budget: ``kv_cache_bytes``, or the GPU's memory x utilization less the
        estimated peak of the profile run (sized from the same options)."""
        return self.kv_budget_bytes

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        return None  # no tensors: the engine's block pool is the whole of the simulated cache

    def step_seconds(self, step: StepInput) -> float:
        """The roofline's time of this step on one GPU, over the efficiency."""
        return self.roofline.cost(work_of(step)).seconds / self.efficiency

    def execute(self, step: StepInput, prev_tokens: None = None) -> SimulatedForward:
        """Queue the step on the simulated GPU and return at once, as a CUDA launch does: it starts
        when the GPU finishes what was queued before and takes the step's time. No logits: the
        simulated sampler waits for it (sleeping: an engine waiting on its simulated GPU uses no
        CPU, as one waiting on a real GPU need not) and draws the tokens."""
        self.ready_at = max(time.perf_counter(), self.ready_at) + self.step_seconds(step)
        return SimulatedForward(self.ready_at)


def work_of(step: StepInput) -> StepWork:
    """What a step computes: each sequence's new tokens end at its seq_len."""
    starts = step.query_start_loc
    return step_work((end - (starts[i + 1] - starts[i]), end) for i, end in enumerate(step.seq_lens))


def sleep_until(deadline: float) -> None:
    """Return at ``deadline`` (``time.perf_counter``) or after it, never before."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
