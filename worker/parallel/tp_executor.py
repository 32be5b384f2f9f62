"""Tensor parallelism across Ray actors, behind the same interface as ModelRunner.

Rank 0 is a ModelRunner in the engine's process; ranks 1..N-1 are TPWorker actors in a
STRICT_PACK placement group (tp_placement.py). Setup (join the process groups, load,
size and allocate the KV cache) goes through Ray calls; then each actor enters a receive
loop and every step is broadcast by rank 0 over gloo as a packed int tensor (step_wire.py
says why). All ranks run the forward; the logits are gathered to rank 0, which samples.

Failure is bounded: a rank that dies closes its sockets, so rank 0's next collective
fails at once; a rank that hangs makes it fail after ``step_timeout_s``. Either way rank 0
tears the group down (kills the actors, leaves the process groups, frees the placement
group) and raises TPWorkerError, naming the actor's own error when Ray knows it. A new
engine can then be built in the same process.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray
import torch
import torch.distributed as dist

from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.lora.request import LoRAConfig, LoRARequest
from pagefleet.worker.model_executor.model_config import ModelConfig
from pagefleet.worker.model_executor.model_runner import ModelRunner, StepInput
from pagefleet.worker.parallel.distributed import (
    ProcessGroups,
    create_rendezvous_store,
    destroy_process_groups,
    init_process_groups,
    rendezvous_host,
)
from pagefleet.worker.parallel.step_wire import (
    broadcast_add_lora,
    broadcast_remove_lora,
    broadcast_step,
    broadcast_stop,
)
from pagefleet.worker.parallel.tp_placement import Placement, acquire_placement, ensure_ray
from pagefleet.worker.parallel.tp_worker import LoadReport, TPWorker, build_runner

logger = logging.getLogger(__name__)

STEP_TIMEOUT_ENV = "PAGEFLEET_TP_STEP_TIMEOUT_S"
DEFAULT_STEP_TIMEOUT_S = 60.0   # a hung rank turns into an error after this long
STARTUP_TIMEOUT_S = 600.0       # actor start, rendezvous and weight load (large checkpoints are slow)
_DEATH_REPORT_WAIT_S = 2.0      # after a failed collective, how long Ray may take to report why
_LIVENESS_POLL_S = 0.1          # CUDA: how often to ask Ray whether the actors live while a step runs


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, hung or failed; the executor has been torn down."""


class TPExecutor:
    def __init__(self, cfg: ModelConfig, args: EngineArgs, device: torch.device, *,
                 step_timeout_s: float | None = None) -> None:
        self.cfg = cfg
        self.size = args.tensor_parallel_size
        if self.size < 2:
            raise ValueError(f"TPExecutor is for tensor_parallel_size >= 2, got {self.size}")
        self.step_timeout_s = step_timeout_s or float(os.environ.get(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S))
        self.device = device
        self.placement: Placement | None = None
        self.actors: list = []
        self.actor_pids: list[int] = []
        self.load_reports: list[LoadReport] = []
        self._loops: list = []  # run_loop futures: one resolves early only if its actor stops or dies
        self._groups: ProcessGroups | None = None
        self._owns_dist = False  # torch.distributed state is this executor's to destroy
        self._failure: str | None = None
        self.rendezvous_host: str | None = None  # where the group's sockets listen (loopback on one node)
        # The engine thread steps while the replica's event loop checks health and may shut
        # down: one lock keeps a step, a teardown and a failure report from interleaving.
        self._lock = threading.RLock()
        ensure_ray(self.size)
        try:
            self.runner = self._start(args)
        except BaseException:
            self._teardown(stop_loops=False)
            raise

    # ---- startup ------------------------------------------------------------------------------

    def _start(self, args: EngineArgs) -> ModelRunner:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                               "engine per process; shut the other one down first")
        use_cuda = self.device.type == "cuda"
        self.placement = acquire_placement(self.size, use_cuda, STARTUP_TIMEOUT_S)
        if self.placement.rank0_cuda_index is not None:
            self.device = torch.device("cuda", self.placement.rank0_cuda_index)
        elif use_cuda and self.device.index is None:
            # Inside a Serve replica (or any Ray actor holding its GPU) Ray narrows
            # CUDA_VISIBLE_DEVICES to that GPU; set_device and NCCL need the index.
            self.device = torch.device("cuda", torch.cuda.current_device())
        if use_cuda:
            torch.cuda.set_device(self.device)
        worker_cls = ray.remote(TPWorker)
        self.actors = [worker_cls.options(scheduling_strategy=self.placement.strategy(rank), max_restarts=0,
                                          **self.placement.actor_resources(rank, use_cuda))
                       .remote(self.cfg, rank, self.size, self.device.type)
                       for rank in range(1, self.size)]
        # Actors up (process started, torch imported) before the rendezvous, so a rank that
        # cannot start fails here with its own error rather than as a rendezvous timeout.
        self.actor_pids = ray.get([a.pid.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
        nodes = ray.get([a.node_id.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
        host = self.rendezvous_host = rendezvous_host(ray.get_runtime_context().get_node_id(), nodes,
                                                      ray.util.get_node_ip_address())
        store = create_rendezvous_store(host, self.size, STARTUP_TIMEOUT_S)
        joins = [a.join.remote(host, store.port, self.step_timeout_s, STARTUP_TIMEOUT_S) for a in self.actors]
        self._owns_dist = True
        self._groups = init_process_groups(rank=0, world_size=self.size, device=self.device, host=host,
                                           port=store.port, step_timeout_s=self.step_timeout_s, store=store)
        ray.get(joins, timeout=STARTUP_TIMEOUT_S)
        lora = LoRAConfig.of(args)
        loads = [a.load.remote(args.load_format, args.seed, args.kv_cache_dtype, args.quantization, lora)
                 for a in self.actors]
        runner, report = build_runner(self.cfg, self._groups, self.device, args.load_format, args.seed,
                                      args.kv_cache_dtype, args.quantization, lora)
        self.load_reports = [report] + ray.get(loads, timeout=STARTUP_TIMEOUT_S)
        for r in self.load_reports:
            logger.info("tensor-parallel rank %d: %.1f MiB of weights, peak RSS +%.1f MiB while loading",
                        r.rank, r.weight_bytes / 2**20, r.peak_rss_delta_bytes / 2**20)
        return runner

    # ---- what the engine calls (ModelRunner's interface) ----------------------------------------

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Per rank: every rank holds the same number of KV heads (its share, or one replica)."""
        return self.runner.kv_bytes_per_block(block_size)

    def available_kv_bytes(self, kv_cache_bytes: int | None, gpu_memory_utilization: float | None,
                           max_num_batched_tokens: int) -> int:
        """Per rank. On CUDA every rank profiles at once (the forward has collectives) and
        the smallest free memory wins; on CPU it is the byte budget."""
        self._raise_if_failed()
        refs = [a.available_kv_bytes.remote(kv_cache_bytes, gpu_memory_utilization, max_num_batched_tokens)
                for a in self.actors]
        mine = self._guarded(self.runner.available_kv_bytes, kv_cache_bytes, gpu_memory_utilization,
                             max_num_batched_tokens)
        return min([mine] + self._get(refs))

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """On every rank, then the actors enter their step loop."""
        self._raise_if_failed()
        refs = [a.allocate_kv_cache.remote(num_blocks, block_size) for a in self.actors]
        self.runner.allocate_kv_cache(num_blocks, block_size)
        self._get(refs)
        if not self._loops:
            self._loops = [a.run_loop.remote() for a in self.actors]

    reads_device_tokens = False  # the other ranks get a step's input ids from rank 0's host

    def execute(self, step: StepInput) -> torch.Tensor:
        """Run one step on every rank; [S, vocab] fp32 logits of the sampling rows."""
        with self._lock:
            self._raise_if_failed()
            if not self._loops:
                raise RuntimeError("allocate_kv_cache must run before the first step")
            return self._guarded(self._execute, step)

    def _execute(self, step: StepInput) -> torch.Tensor:
        broadcast_step(step, self._groups.control)
        logits = self.runner.execute(step)
        if self.device.type == "cuda":
            self._wait_for_device()
        return logits

    def add_lora(self, request: LoRARequest) -> None:
        """Rank 0 reads and checks the adapter first (a bad one raises here and no rank holds it),
        then every other rank registers it from the step wire."""
        with self._lock:
            self._raise_if_failed()
            self.runner.add_lora(request)
            self._guarded(broadcast_add_lora, request, self._groups.control)

    def remove_lora(self, lora_int_id: int) -> None:
        with self._lock:
            self._raise_if_failed()
            self.runner.remove_lora(lora_int_id)
            self._guarded(broadcast_remove_lora, lora_int_id, self._groups.control)

    def check_health(self) -> None:
        """Raise TPWorkerError if a rank's actor has died, even while the engine is idle.
        While a step runs the step itself watches the actors, so this does not wait."""
        self._raise_if_failed()
        if not self._lock.acquire(blocking=False):
            return
        try:
            done, _ = ray.wait(self._loops, num_returns=1, timeout=0) if self._loops else ([], [])
            if done:
                raise self._fail(RuntimeError("a tensor-parallel actor stopped while the engine was idle"))
        finally:
            self._lock.release()

    def shutdown(self) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = "the tensor-parallel executor is shut down"
                self._teardown(stop_loops=True)

    # ---- failure ---------------------------------------------------------------------------------

    def _wait_for_device(self) -> None:
        """NCCL waits on a dead peer forever on the GPU, so rank 0 does not block in a CUDA
        sync: it polls the step's completion, asking Ray every _LIVENESS_POLL_S whether
        the actors live, up to the step timeout."""
        done = torch.cuda.Event()
        done.record()
        start = last_check = time.monotonic()
        while not done.query():
            now = time.monotonic()
            if now - start > self.step_timeout_s:
                raise TimeoutError(f"a tensor-parallel step did not finish within {self.step_timeout_s:.0f} s")
            if now - last_check > _LIVENESS_POLL_S:
                last_check = now
                if ray.wait(self._loops, num_returns=1, timeout=0)[0]:
                    raise RuntimeError("a tensor-parallel actor stopped during the step")
            time.sleep(0)

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            raise self._fail(e) from e
        except BaseException:  # e.g. KeyboardInterrupt: the ranks are out of step now
            self._fail(RuntimeError("interrupted during a tensor-parallel step"))
            raise

    def _get(self, refs: list) -> list:
        try:
            return ray.get(refs, timeout=self.step_timeout_s)
        except Exception as e:
            raise self._fail(e) from e

    def _fail(self, error: BaseException) -> TPWorkerError:
        """Tear everything down and build the error to raise, with the dead rank's cause."""
        causes = self._actor_failures()
        detail = "; ".join(causes) if causes else (
            f"no actor died, so a rank is hung or rank 0 failed (step timeout {self.step_timeout_s:.0f} s): "
            f"{type(error).__name__}: {_first_line(error)}")
        self._failure = f"tensor-parallel group of {self.size} ranks failed: {detail}"
        logger.error("%s; tearing the group down", self._failure)
        self._teardown(stop_loops=False)
        return TPWorkerError(self._failure)

    def _actor_failures(self) -> list[str]:
        if not self._loops:
            return []
        ray.wait(self._loops, num_returns=1, timeout=_DEATH_REPORT_WAIT_S)
        done, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        causes = []
        for rank, loop in enumerate(self._loops, start=1):
            if loop not in done:
                continue
            try:
                ray.get(loop)
                causes.append(f"rank {rank} left its step loop")
            except ray.exceptions.RayActorError as e:
                causes.append(f"rank {rank} (pid {self.actor_pids[rank - 1]}) died: {_first_line(e)}")
            except ray.exceptions.RayTaskError as e:
                cause = e.cause or e
                causes.append(f"rank {rank} raised {type(cause).__name__}: {_first_line(cause)}")
        return causes

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise TPWorkerError(self._failure)

    def _teardown(self, stop_loops: bool) -> None:
        """Stop and kill the actors, leave the process groups, free the placement group.
        Actors die before rank 0 leaves the groups, so nothing waits on a peer."""
        if stop_loops and self._loops and self._groups is not None:
            try:
                broadcast_stop(self._groups.control)
                ray.get(self._loops, timeout=self.step_timeout_s)
            except Exception as e:  # noqa: BLE001 — a clean stop is best effort; kill below
                logger.warning("tensor-parallel actors did not stop cleanly: %s", e)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        try:
            if self._owns_dist:
                self._owns_dist = False
                destroy_process_groups(abort=not stop_loops)
        finally:
            self._groups = None
            if self.placement is not None:
                self.placement.release()
            self.actors, self._loops = [], []


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
