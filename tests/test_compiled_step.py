"""The compiled step's switches and its attention context (no compiling here)."""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels.flex_paged_attention import FlexPlan
from pagefleet.worker.compiled_step import attention_plan
from pagefleet.worker.engine_args import ENFORCE_EAGER_ENV, EngineArgs
from pagefleet.worker.model_runner import _synthetic_step


def test_enforce_eager_defaults_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENFORCE_EAGER_ENV, "1")
    assert EngineArgs().enforce_eager is True
    assert EngineArgs(enforce_eager=False).enforce_eager is False
    monkeypatch.setenv(ENFORCE_EAGER_ENV, "0")
    assert EngineArgs().enforce_eager is False
    monkeypatch.delenv(ENFORCE_EAGER_ENV)
    assert EngineArgs().enforce_eager is False


def test_attention_plan_refuses_nesting_and_the_op_needs_one():
    plan = FlexPlan(torch.zeros(4, dtype=torch.int32), [], [])
    with attention_plan(plan):
        with pytest.raises(RuntimeError, match="already set"):
            with attention_plan(plan):
                pass
    q = torch.zeros(1, 2, 4)
    cache = torch.zeros(4, 16, 1, 4)
    with pytest.raises(RuntimeError, match="outside attention_plan"):
        torch.ops.pagefleet.flex_paged_attention(q, q[:, :1], q[:, :1], cache, cache.clone(),
                                                  torch.zeros(1, dtype=torch.int64), 0.5)


def test_warm_up_steps_use_fresh_blocks_in_order():
    step = _synthetic_step([(1, 4), (5, 5), (3, 20)], block_size=16)
    assert step.block_tables == [[0], [1], [2, 3]]
    assert step.query_start_loc == [0, 1, 6, 9]
    assert step.positions == [3, 0, 1, 2, 3, 4, 17, 18, 19]
    assert step.slot_mapping == [3, 16, 17, 18, 19, 20, 49, 50, 51]
    assert step.logits_indices == [0, 5, 8]
