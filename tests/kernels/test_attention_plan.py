"""The kernel table's attention planning (kernels/ops.py): the twins and the Triton kernels plan
nothing; the CPU engine's compiled table (kernels/cpu/backend.py) plans each step's decode rows
as its C++ decode attention reads them, and its attention over that plan equals the twin's.

fp32 tolerance as in test_cpu_decode_attention.py: the kernel's online softmax sums in another
order than the twin's SDPA, a few ulps per term, 8 eps * max|V|."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagefleet.kernels import ops, reference
from pagefleet.kernels.cpu import build as cpu_build, decode_attention as cpu, fused_ops as fused
from pagefleet.kernels.cpu.backend import compiled_cpu_kernels
from pagefleet.kernels.testing import make_paged_batch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 16
# (q_len, seq_len) per sequence: decode rows 0, 2, 5 among prompts and prefill chunks.
MIXED = [(1, 33), (12, 30), (1, 8), (9, 9), (35, 80), (1, 64), (2, 2)]


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path_factory):
    # One kernel cache for this module's tests, not the user's.
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "pagefleet-cache"))


@pytest.fixture
def twins(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    return ops.select_kernels("cpu")


def _batch(seqs, seed=0):
    return make_paged_batch(seqs, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                            dtype=torch.float32, extra_blocks=40, seed=seed)


SPEC = ops.AttentionSpec(torch.float32, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)


def _step(batch) -> tuple:
    """What the model runner hands a planner each step."""
    return batch.block_table, batch.seq_lens, batch.query_start_loc.tolist(), batch.seq_lens.tolist()


def test_the_twins_plan_nothing(twins):
    assert twins.attention_planner(SPEC)(*_step(_batch(MIXED))) is None
    assert (twins.compiled, str(twins)) == ("", "torch")


def test_the_triton_kernels_plan_nothing(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    kernels = ops.select_kernels("cpu")
    assert kernels.attention_planner(SPEC)(*_step(_batch(MIXED))) is None
    assert (kernels.compiled, str(kernels)) == ("", "triton")


def test_the_compiled_table_is_the_twins_with_the_cpp_kernels_in_place(twins):
    kernels = compiled_cpu_kernels(twins)
    assert (kernels.rms_norm, kernels.fused_add_rms_norm, kernels.rotary_embedding) == (
        fused.rms_norm, fused.fused_add_rms_norm, fused.rotary_embedding)
    assert (kernels.paged_attention, kernels.attention_planner) == (cpu.paged_attention, cpu.decode_attention_planner)
    assert (kernels.silu_and_mul, kernels.write_kv_cache, kernels.backend) == (
        twins.silu_and_mul, twins.write_kv_cache, "torch")
    assert str(kernels) == "torch with the C++ decode attention, norms and rotary"


def test_only_the_twins_take_the_cpp_kernels(twins):
    with pytest.raises(ValueError, match="replace the PyTorch twins, not 'triton' kernels"):
        compiled_cpu_kernels(dataclasses.replace(twins, backend="triton"))


def test_the_compiled_plan_of_a_mixed_step_is_its_decode_rows(twins):
    batch = _batch(MIXED, seed=1)
    kernels = compiled_cpu_kernels(twins)
    plan = kernels.attention_planner(SPEC)(*_step(batch))
    # What the model runner computed itself before planning moved into the table.
    kernel = cpu.decode_kernel(torch.float32, HEAD_DIM, HEADS // KV_HEADS, KV_HEADS, BLOCK_SIZE)
    old = cpu.plan_decode(*_step(batch), kernel)
    assert plan.kernel is kernel is old.kernel
    assert plan.rows.tolist() == old.rows.tolist() == [0, 13, 58]  # sequences 0, 2, 5's tokens
    assert plan.multi == old.multi == [1, 3, 4, 6]
    assert plan.seq_lens.tolist() == old.seq_lens.tolist() == [33, 8, 64]
    assert torch.equal(plan.block_table, batch.block_table[[0, 2, 5]])
    assert torch.equal(plan.block_table, old.block_table)
    assert (plan.starts, plan.lens) == (old.starts, old.lens) == (batch.query_start_loc.tolist(),
                                                                  batch.seq_lens.tolist())
    scale = HEAD_DIM ** -0.5
    with torch.inference_mode():  # as the engine calls it
        got = kernels.paged_attention(*batch.args(), scale, plan=plan)
    want = reference.paged_attention(*batch.args(), scale)
    atol = 8 * torch.finfo(torch.float32).eps * batch.value_cache.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def test_a_compiled_step_without_decode_rows_plans_nothing_and_runs_the_twin(twins):
    batch = _batch([(5, 5), (3, 20)], seed=2)
    kernels = compiled_cpu_kernels(twins)
    plan = kernels.attention_planner(SPEC)(*_step(batch))
    assert plan is None
    scale = HEAD_DIM ** -0.5
    assert torch.equal(kernels.paged_attention(*batch.args(), scale, plan=plan),
                       reference.paged_attention(*batch.args(), scale))
