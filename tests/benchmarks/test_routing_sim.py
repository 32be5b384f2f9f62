"""benchmarks/_routing_sim.py: the multi-tenant chat workload, its oracle, and the capacity and
pool sizes derived from the simulated engine's roofline."""

import sys
from pathlib import Path

import pytest

from pagefleet.worker.simulated.roofline import StepRoofline, step_work

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _routing_sim import (
    BLOCK,
    ChatShape,
    ChatWorkload,
    fleet_capacity,
    oracle_hit_rate,
    prefill_seconds,
    pressure_kv_bytes,
)

SHAPE = ChatShape(tenants=3, system_tokens=32, turn_tokens=5, answer_tokens=4)


def test_every_request_is_its_tenants_system_prompt_then_a_turn_of_its_own():
    work = ChatWorkload(SHAPE, seed=7, first_tenant=30)
    requests = [work.request() for _ in range(40)]
    assert {t for t, _ in requests} == {30, 31, 32}
    for tenant, prompt in requests:
        assert len(prompt) == 37
        assert prompt[:32] == work.prefixes[tenant - 30]
    assert len({tuple(p[:32]) for p in work.prefixes}) == 3
    again = ChatWorkload(SHAPE, seed=7, first_tenant=30)
    assert [again.request() for _ in range(40)] == requests


def test_a_system_prompt_ends_on_a_block_boundary():
    with pytest.raises(ValueError, match="multiple of 16"):
        ChatWorkload(ChatShape(2, BLOCK + 1, 5, 4), seed=0)


def test_the_oracle_hits_every_system_prompt_after_its_tenants_first_request():
    # tenants 1, 2, 1, 1, 3, 2: three first requests, three hits of 32 of 37 tokens
    assert oracle_hit_rate([1, 2, 1, 1, 3, 2], SHAPE) == 3 * 32 / (6 * 37)
    assert oracle_hit_rate([5], SHAPE) == 0.0
    assert oracle_hit_rate([], SHAPE) == 0.0


# A GPU of 1 byte/s and 1 FLOP/s with 1-byte weights and one FLOP per parameter: every step's
# time is its FLOPs or bytes, so the sums below are exact.
ROOF = StepRoofline(weight_bytes=1, matmul_params=1, kv_bytes_per_token=0, attention_flops_per_key=0,
                    bandwidth=1.0, peak_flops=1.0)


def test_a_prefill_is_its_chunks_steps_over_the_efficiency():
    # 37 tokens in chunks of 16: steps of 16, 16 and 5 tokens, 2 FLOPs a token
    assert prefill_seconds(ROOF, 37, chunk=16, efficiency=0.5) == (32 + 32 + 10) / 0.5
    assert ROOF.cost(step_work([(0, 37)])).seconds == 74


def test_capacity_is_the_fleet_computing_whole_prompts():
    assert fleet_capacity(ROOF, SHAPE, workers=4, chunk=2048, efficiency=1.0) == 4 / 74


def test_the_pressure_pool_holds_the_prefixes_and_each_running_requests_own_blocks():
    # 2 blocks a prefix; a request's own: its turn and answer (9 tokens, 1 block) and one more,
    # as they can straddle a block boundary
    assert pressure_kv_bytes(SHAPE, prefixes=5, running=3, kv_bytes_per_token=2) == (5 * 2 + 3 * 2) * BLOCK * 2
