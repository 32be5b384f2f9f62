"""max_loras in the scheduler: the running sequences name at most max_loras adapters; a waiting
sequence whose adapter would be one too many waits while those behind it (the base model, an
adapter already running) go first, and it is admitted once its slot frees."""

from __future__ import annotations

from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.lora.request import LoRARequest
from pagefleet.worker.model_executor.step_input import build_step_input
from pagefleet.worker.sampling_params import SamplingParams

BS = 4
LORAS = {i: LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3)}


def _seq(seq_id: int, lora: int | None, max_tokens: int = 4) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(seq_id, f"r{seq_id}", 0, [100 * seq_id + t for t in range(BS)], params,
                    lora_request=None if lora is None else LORAS[lora])


def test_an_adapter_over_max_loras_waits_and_the_rest_go_first():
    kv = KVCacheManager(BlockPool(32, False), BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2)
    seqs = [_seq(0, 1, max_tokens=1), _seq(1, 2), _seq(2, 3), _seq(3, None), _seq(4, 1)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert [item.seq.seq_id for item in out.scheduled] == [0, 1, 3, 4]  # adapter 3 would be a third
    assert [s.seq_id for s in sched.waiting] == [2]
    step = build_step_input(out, BS, lambda seq: kv.block_ids(seq))
    assert step.lora_ids == [1, 2, None, 1]
    sched.advance(out)
    kv.commit_step()
    for seq in out.sampled_seqs():
        seq.append_token(7)
    sched.finish(seqs[0], "length")  # adapter 1 still runs in seq 4: its slot is not free
    assert [item.seq.seq_id for item in sched.schedule().scheduled] == [1, 3, 4]


def test_the_adapter_is_admitted_once_a_slot_frees():
    kv = KVCacheManager(BlockPool(32, False), BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)
    first, second, base = _seq(0, 1), _seq(1, 2), _seq(2, None)
    for seq in (first, second, base):
        sched.add(seq)
    assert [item.seq.seq_id for item in sched.schedule().scheduled] == [0, 2]
    sched.finish(first, "abort")
    assert [item.seq.seq_id for item in sched.schedule().scheduled] == [2, 1]


def test_a_step_without_adapters_names_none():
    kv = KVCacheManager(BlockPool(32, False), BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2)
    sched.add(_seq(0, None))
    out = sched.schedule()
    assert build_step_input(out, BS, lambda seq: kv.block_ids(seq)).lora_ids == []
