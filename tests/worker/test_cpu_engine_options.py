"""The CPU engine's own options: its compute thread count and enforce_eager's default (compiled)."""

from __future__ import annotations

import pytest
import torch

from pagefleet.worker import LLM
from pagefleet.worker.cpu.threads import available_cores, compute_thread_env, cpu_compute_threads
from pagefleet.worker.engine_args import EngineArgs


def test_compute_threads_take_every_core_shared_among_ranks_unless_asked():
    assert [cpu_compute_threads(None, cores) for cores in (1, 2, 4, 64)] == [1, 2, 4, 64]
    assert [cpu_compute_threads(None, 8, ranks) for ranks in (1, 2, 3, 16)] == [8, 4, 2, 1]
    assert cpu_compute_threads(1, 2) == 1
    assert cpu_compute_threads(8, 2) == 8  # asked for: oversubscribing is the user's call


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_cpu_omp_threads_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="cpu_omp_threads must be an integer >= 1"):
        EngineArgs(cpu_omp_threads=bad)


def test_engine_sets_the_process_thread_count(tiny_checkpoint):
    before = torch.get_num_threads()
    try:
        LLM(model=str(tiny_checkpoint(arch="llama")), dtype="float32", kv_cache_bytes=4 << 20, cpu_omp_threads=3)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_an_engine_computes_on_every_core_unless_asked(tiny_checkpoint):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        LLM(model=str(tiny_checkpoint(arch="llama")), dtype="float32", kv_cache_bytes=4 << 20, enforce_eager=True)
        assert torch.get_num_threads() == available_cores()
    finally:
        torch.set_num_threads(before)


def test_compiled_unless_asked(tiny_checkpoint):
    assert EngineArgs().enforce_eager is False
    assert EngineArgs(enforce_eager=True).enforce_eager is True
    eager = LLM(model=str(tiny_checkpoint(arch="llama")), dtype="float32", kv_cache_bytes=4 << 20,
                enforce_eager=True)
    assert eager.engine.executor.runner.compiled_kernels is False


def test_an_engine_with_every_core_to_itself_spins_its_team_unless_the_user_set_libgomp():
    spin = {"GOMP_SPINCOUNT": "300000"}
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}  # what `pagefleet serve` gives every Ray process
    assert compute_thread_env(2, 2, passive) == spin
    assert compute_thread_env(64, 64, {}) == spin
    assert compute_thread_env(1, 1, passive) == {}  # no team to wait for
    assert compute_thread_env(2, 4, passive) == {}  # cores someone else may need
    assert compute_thread_env(4, 2, passive) == {}  # oversubscribed
    assert compute_thread_env(2, 2, {**passive, "GOMP_SPINCOUNT": "0"}) == {}
    assert compute_thread_env(2, 2, {"OMP_WAIT_POLICY": "active"}) == {}


def test_only_a_lone_one_rank_cpu_worker_gets_the_spin_on_top_of_the_jobs_runtime_env():
    from pagefleet.cluster.app import worker_runtime_env

    engine = EngineArgs(cpu_omp_threads=4)
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    job = {"pip": ["x"], "env_vars": {"HF_TOKEN": "t"}}

    def env(args=engine, workers=1, gpus=0.0, cores=4, job_env=job, environ=passive):
        return worker_runtime_env(args, workers, gpus, cores, job_env, environ)

    # Serve gives a deployment the job's runtime_env only when it has none: the spin comes on top of it.
    assert env() == {"pip": ["x"], "env_vars": {"HF_TOKEN": "t", "GOMP_SPINCOUNT": "300000"}}
    assert env(job_env={}) == {"env_vars": {"GOMP_SPINCOUNT": "300000"}}
    assert env(EngineArgs(cpu_omp_threads=2), workers=2, cores=2) is None  # replicas share the cores
    assert env(gpus=1.0) is None  # the GPU computes
    assert env(EngineArgs(cpu_omp_threads=4, device="cuda")) is None
    assert env(EngineArgs(cpu_omp_threads=2, tensor_parallel_size=2)) is None
    assert env(EngineArgs(cpu_omp_threads=2)) is None  # cores someone else may use
    # the user's own libgomp setting wins, from this process's environment or the job's
    assert env(environ={"GOMP_SPINCOUNT": "0"}) is None
    assert env(job_env={"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}) is None
