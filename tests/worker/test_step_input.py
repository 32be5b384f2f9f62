"""A step launched ahead (async scheduling) as plain data: its first sequences name the rows of
the previous step's sampled tokens they take (``prev_token_rows``), the device writes those
tokens into its input ids, and no other rank is sent such a step."""

from __future__ import annotations

import pytest
import torch

from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.model_executor.step_buffers import StepBuffers
from pagefleet.worker.model_executor.step_input import StepInput, build_step_input
from pagefleet.worker.parallel.step_wire import pack_step
from pagefleet.worker.sampling_params import SamplingParams

BS = 4


def _engine_state():
    kv = KVCacheManager(BlockPool(32, False), BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seqs = [Sequence(i, str(i), 0, list(range(10 + i, 15 + 2 * i)), params) for i in range(3)]
    for seq in seqs[:2]:
        sched.add(seq)
    return kv, sched, seqs


def test_a_step_scheduled_ahead_reads_the_sampled_rows_of_its_sequences_and_admits_the_waiting():
    kv, sched, seqs = _engine_state()
    out = sched.schedule()  # the prompts of sequences 0 (5 tokens) and 1 (6 tokens)
    sched.advance(out)
    seqs[0].params = SamplingParams(temperature=0.0, max_tokens=1)  # the token being sampled ends it
    sched.add(seqs[2])  # 7 prompt tokens, waiting
    ahead = sched.schedule_ahead(out, max_model_len=64)
    assert ahead.prev_token_rows == [1] and [(i.seq.seq_id, i.num_new_tokens) for i in ahead.scheduled] == [
        (1, 1), (2, 7)]
    step = build_step_input(ahead, BS, kv.block_ids)
    t1, t2 = kv.block_ids(seqs[1]), kv.block_ids(seqs[2])
    assert step == StepInput(
        input_ids=[0] + list(range(12, 19)),  # a placeholder for sequence 1's token being sampled, then 2's prompt
        positions=[6] + list(range(7)),
        slot_mapping=[t1[1] * BS + 2] + [t2[p // BS] * BS + p % BS for p in range(7)],
        block_tables=[t1, t2], query_start_loc=[0, 1, 8], seq_lens=[7, 7], logits_indices=[0, 7],
        prev_token_rows=[1])


def test_nothing_is_scheduled_ahead_of_a_step_that_leaves_prompt_to_compute():
    kv, _, seqs = _engine_state()
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=6)
    sched.add(seqs[2])
    out = sched.schedule()  # 6 of its 7 prompt tokens: nothing sampled
    sched.advance(out)
    assert sched.schedule_ahead(out, max_model_len=64) is None


def test_the_buffers_write_the_previous_steps_tokens_into_the_first_input_ids():
    buffers = StepBuffers(max_tokens=8, max_seqs=4, max_blocks=2, device=torch.device("cpu"))
    step = StepInput([0, 0, 31, 32], [5, 9, 0, 1], [5, 9, 12, 13], [[0, 1], [2, 3], [3]], [0, 1, 2, 4], [6, 10, 2],
                     [0, 1, 3], prev_token_rows=[2, 0])
    buffers.fill(step)
    buffers.take_prev_tokens(step, torch.tensor([71, 72, 73]))
    assert buffers.input_ids(4).tolist() == [73, 71, 31, 32]
    with pytest.raises(ValueError, match="runs on one rank only"):
        pack_step(step)


def test_a_plain_step_takes_no_previous_tokens():
    kv, sched, seqs = _engine_state()
    step = build_step_input(sched.schedule(), BS, kv.block_ids)
    assert step.prev_token_rows == [] and step.input_ids == seqs[0].token_ids + seqs[1].token_ids
