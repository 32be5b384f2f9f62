"""The packed-int64 form of a StepInput that rank 0 broadcasts to the other ranks."""

import pytest
import torch

from pagefleet.worker.lora.request import LoRARequest
from pagefleet.worker.model_executor.model_runner import StepInput
from pagefleet.worker.parallel.step_wire import pack_lora, pack_step, unpack_lora, unpack_step


def _step() -> StepInput:
    # A 3-token prefill chunk of a sequence with two blocks next to a decode of one with one
    # block, and a sequence mid-chunk (no sampled row): ragged block tables, S < B.
    return StepInput(input_ids=[11, 12, 13, 7, 21], positions=[16, 17, 18, 4, 0], slot_mapping=[64, 65, 66, 4, 80],
                     block_tables=[[3, 4], [0], [5]], query_start_loc=[0, 3, 4, 5], seq_lens=[19, 5, 1],
                     logits_indices=[2, 3])


def test_round_trip_keeps_every_field():
    step = _step()
    payload = pack_step(step)
    assert payload.dtype == torch.int64
    assert payload.tolist()[:3] == [5, 3, 2]
    assert unpack_step(payload) == step


def test_empty_block_table_row_and_no_sampled_rows():
    step = StepInput([1], [0], [0], [[]], [0, 1], [1], [])
    assert unpack_step(pack_step(step)) == step


def test_inconsistent_step_is_refused():
    step = _step()
    step.positions = step.positions[:-1]
    with pytest.raises(ValueError, match="inconsistent StepInput"):
        pack_step(step)


def test_payload_with_extra_values_is_refused():
    payload = torch.cat([pack_step(_step()), torch.tensor([9])])
    with pytest.raises(ValueError, match="accounts for"):
        unpack_step(payload)


def test_lora_ids_round_trip_with_base_rows():
    step = _step()
    step.lora_ids = [2, None, 7]
    payload = pack_step(step)
    assert payload.tolist()[:4] == [5, 3, 2, 3]
    assert payload.tolist()[-3:] == [2, 0, 7]  # the base model's row is 0 on the wire (ids are >= 1)
    assert unpack_step(payload) == step


def test_lora_ids_must_name_every_row():
    step = _step()
    step.lora_ids = [2, None]
    with pytest.raises(ValueError, match="2 lora ids for 3 sequences"):
        pack_step(step)


def test_an_adapter_to_register_round_trips():
    request = LoRARequest("sql-ünï", 3, "/adapters/sql ünï")
    assert unpack_lora(pack_lora(request)) == request
    with pytest.raises(ValueError, match="accounts for"):
        unpack_lora(torch.cat([pack_lora(request), torch.tensor([9])]))
