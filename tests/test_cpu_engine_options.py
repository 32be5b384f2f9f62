"""The CPU engine's own options: its compute thread count and enforce_eager's default (compiled),
and the synthetic step that warms up the compiled decode attention."""

from __future__ import annotations

import pytest
import torch

from pagefleet.worker import LLM
from pagefleet.worker.cpu_threads import available_cores, cpu_compute_threads
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.model_runner import _synthetic_step


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
    assert eager.engine.executor.runner.decode_planner is None


def test_warm_up_steps_use_fresh_blocks_in_order():
    step = _synthetic_step([(1, 4), (5, 5), (3, 20)], block_size=16)
    assert step.block_tables == [[0], [1], [2, 3]]
    assert step.query_start_loc == [0, 1, 6, 9]
    assert step.positions == [3, 0, 1, 2, 3, 4, 17, 18, 19]
    assert step.slot_mapping == [3, 16, 17, 18, 19, 20, 49, 50, 51]
    assert step.logits_indices == [0, 5, 8]
