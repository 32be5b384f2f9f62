"""One build of the CPU decode attention kernel serves every engine of a model shape: the KV
pool's block count and the step's row count are arguments, not constants of the kernel, so a
second engine with another pool, running batches of another size, compiles nothing (counted
compiler runs, not timed)."""

from __future__ import annotations

from pagefleet.kernels import cpu_decode_attention
from pagefleet.worker import LLM, SamplingParams


def _generate(llm: LLM, num_prompts: int) -> list[list[int]]:
    prompts = [{"prompt_token_ids": list(range(3, 3 + 5 * (i + 1)))} for i in range(num_prompts)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_second_engine_with_other_pool_and_batch_builds_nothing(tiny_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_decode_attention.CACHE_ENV, str(tmp_path))  # an empty kernel cache
    cpu_decode_attention.load_kernel.cache_clear()
    path = str(tiny_checkpoint(arch="llama"))
    builds = cpu_decode_attention.builds
    first = LLM(model=path, dtype="float32", kv_cache_bytes=8 << 20)  # the default: compiled
    assert first.engine.executor.runner.cpu_decode
    assert cpu_decode_attention.builds == builds + 1  # at start, before any request
    assert [len(ids) for ids in _generate(first, 3)] == [6] * 3

    second = LLM(model=path, dtype="float32", kv_cache_bytes=20 << 20)
    assert (first.engine.pool.num_blocks, second.engine.pool.num_blocks) == (512, 1280)
    assert [len(ids) for ids in _generate(second, 7)] == [6] * 7
    assert cpu_decode_attention.builds == builds + 1
    assert len(list((tmp_path / "cpu_kernels").glob("*.so"))) == 1
    cpu_decode_attention.load_kernel.cache_clear()  # later tests load from their own cache directory
