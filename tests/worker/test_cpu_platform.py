"""The platform boundary: the generic model runner, model and executor ask the platform of their
device (worker/model_executor/platform.py) for what only that device needs, and the CPU's set-up
lives in worker/cpu/platform.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from pagefleet.kernels import ops
from pagefleet.kernels.cpu import build as cpu_build
from pagefleet.kernels.cpu.decode_attention import decode_kernel, plan_decode
from pagefleet.worker import LLM
from pagefleet.worker.cpu import platform as cpu_platform
from pagefleet.worker.cpu.platform import CpuPlatform
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.model_executor.model_runner import StepInput
from pagefleet.worker.model_executor.platform import CudaPlatform, platform_for

ROOT = Path(__file__).resolve().parents[2]
GENERIC = ["worker/model_executor/model_runner.py", "worker/model_executor/model.py", "worker/parallel/executor.py"]
CPU_PACKAGES = ("pagefleet.kernels.cpu", "pagefleet.worker.cpu")


def _imports(tree: ast.AST) -> list[str]:
    """Every module an import statement anywhere in ``tree`` names (``from a import b``: a and a.b)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("path", GENERIC)
def test_the_generic_engine_files_neither_import_the_cpu_platform_nor_branch_on_cpu(path):
    tree = ast.parse((ROOT / path).read_text())
    assert [n for n in _imports(tree) if any(n == p or n.startswith(p + ".") for p in CPU_PACKAGES)] == []
    compared_with_cpu = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
                         and any(isinstance(x, ast.Constant) and x.value == "cpu"
                                 for x in [node.left, *node.comparators])]
    assert compared_with_cpu == []


def test_the_platform_comes_from_the_device():
    assert isinstance(platform_for(torch.device("cpu")), CpuPlatform)
    assert platform_for("cpu") is platform_for(torch.device("cpu"))
    assert isinstance(platform_for(torch.device("cuda", 1)), CudaPlatform)
    assert platform_for("cuda") is platform_for(torch.device("cuda", 0))


def test_the_cpu_platform_compiles_the_twins_unless_eager_or_triton(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    cpu, device = platform_for("cpu"), torch.device("cpu")
    compiled = cpu.select_kernels(device, enforce_eager=False)
    assert str(compiled) == "torch with the C++ decode attention, norms and rotary"
    assert str(cpu.select_kernels(device, enforce_eager=True)) == "torch"
    pytest.importorskip("triton")
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    assert str(cpu.select_kernels(device, enforce_eager=False)) == "triton"


def test_the_cuda_platform_sets_up_nothing_beyond_its_kernels(monkeypatch):
    cuda = platform_for("cuda")
    monkeypatch.setenv(ops.ENV_VAR, "torch")  # the twins on a CUDA device: the CPU's C++ kernels never come
    assert str(cuda.select_kernels(torch.device("cuda"), enforce_eager=False)) == "torch"
    args = EngineArgs(cpu_omp_threads=3)
    got_args, pinned = cuda.prepare_step_thread(args)
    assert got_args is args and pinned == {}
    before = torch.get_num_threads()
    cuda.set_compute_threads(EngineArgs(cpu_omp_threads=before + 1))
    assert torch.get_num_threads() == before


def test_the_cpu_step_thread_gets_the_engine_thread_count_taken_before_the_pinning(monkeypatch):
    # prepare_engine_thread itself (priority and pinning) is tested through AsyncLLMEngine; here
    # only what the platform hands it and fills in, without touching this test's own thread.
    calls = []
    monkeypatch.setattr(cpu_platform, "available_cores", lambda: 4)
    monkeypatch.setattr(cpu_platform, "prepare_engine_thread", lambda threads: calls.append(threads) or {7: 0})
    cpu = platform_for("cpu")
    args, pinned = cpu.prepare_step_thread(EngineArgs())
    assert (args.cpu_omp_threads, pinned) == (4, {7: 0})
    assert cpu.prepare_step_thread(EngineArgs(cpu_omp_threads=2))[0].cpu_omp_threads == 2
    tp_args = EngineArgs(tensor_parallel_size=2)
    assert cpu.prepare_step_thread(tp_args)[0] is tp_args  # tensor-parallel ranks keep torch's count
    assert calls == [4, 2, None]


def _mixed_step() -> StepInput:
    # Sequence 0 decodes its 21st token, sequence 1 prefills a 5-token prompt, sequence 2 decodes its 9th.
    return StepInput(input_ids=[11, 3, 4, 5, 6, 7, 12], positions=[20, 0, 1, 2, 3, 4, 8],
                     slot_mapping=[20, 32, 33, 34, 35, 36, 56], block_tables=[[0, 1], [2], [3]],
                     query_start_loc=[0, 1, 6, 7], seq_lens=[21, 5, 9], logits_indices=[0, 5, 6])


def test_a_cpu_runner_plans_a_mixed_step_as_the_decode_attention_reads_it(tiny_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "cache"))
    path = str(tiny_checkpoint(arch="llama"))
    runner = LLM(model=path, dtype="float32", kv_cache_bytes=4 << 20).engine.executor.runner
    step = _mixed_step()
    _, _, meta, _ = runner._tensors(step)
    attn = runner.model.layers[0].self_attn
    # What the runner computed itself before planning moved into the kernel table.
    kernel = decode_kernel(torch.float32, attn.head_dim, attn.num_heads // attn.num_kv_heads, attn.num_kv_heads, 16)
    old = plan_decode(meta.block_table, meta.seq_lens, step.query_start_loc, step.seq_lens, kernel)
    plan = meta.attn_plan
    assert plan.kernel is kernel
    assert plan.rows.tolist() == old.rows.tolist() == [0, 6]
    assert plan.multi == old.multi == [1]
    assert plan.block_table.tolist() == old.block_table.tolist() == [[0, 1], [3, 0]]
    assert plan.seq_lens.tolist() == old.seq_lens.tolist() == [21, 9]
    assert (plan.starts, plan.lens) == (old.starts, old.lens) == ([0, 1, 6, 7], [21, 5, 9])

    eager = LLM(model=path, dtype="float32", kv_cache_bytes=4 << 20, enforce_eager=True).engine.executor.runner
    assert eager._tensors(step)[2].attn_plan is None
