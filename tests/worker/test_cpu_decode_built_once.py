"""One build of the CPU kernels serves every engine of a model shape: the KV pool's block count
and the step's row count are arguments, not constants of the kernels, so a second engine with
another pool, running batches of another size, compiles nothing (counted compiler runs, not
timed)."""

from __future__ import annotations

from pagefleet.kernels.cpu import build as cpu_build
from pagefleet.kernels.testing import forget_loaded_cpu_kernels
from pagefleet.worker import LLM, SamplingParams


def _generate(llm: LLM, num_prompts: int) -> list[list[int]]:
    prompts = [{"prompt_token_ids": list(range(3, 3 + 5 * (i + 1)))} for i in range(num_prompts)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_second_engine_with_other_pool_and_batch_builds_nothing(tiny_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))  # an empty kernel cache
    forget_loaded_cpu_kernels()
    path = str(tiny_checkpoint(arch="llama"))
    builds = cpu_build.builds
    first = LLM(model=path, dtype="float32", kv_cache_bytes=8 << 20)  # the default: compiled
    assert first.engine.executor.runner.compiled_kernels
    assert cpu_build.builds == builds + 2  # at start, before any request: the decode attention, the fused ops
    assert [len(ids) for ids in _generate(first, 3)] == [6] * 3

    second = LLM(model=path, dtype="float32", kv_cache_bytes=20 << 20)
    assert (first.engine.pool.num_blocks, second.engine.pool.num_blocks) == (512, 1280)
    assert [len(ids) for ids in _generate(second, 7)] == [6] * 7
    assert cpu_build.builds == builds + 2
    assert sorted(p.name.split("_")[0] for p in (tmp_path / "cpu_kernels").glob("*.so")) == ["decode", "fused"]
    forget_loaded_cpu_kernels()  # later tests load from their own cache directory
