"""One compile of the paged decode attention serves every engine of a model shape: the KV pool's
block count and the step's decode row count are dynamic sizes of the compiled kernel, so a second
engine with another pool, running batches of another size, compiles nothing (counted by dynamo,
not timed)."""

from __future__ import annotations

from torch._dynamo.utils import counters

from pagefleet.worker import LLM, SamplingParams


def _generate(llm: LLM, num_prompts: int) -> list[list[int]]:
    prompts = [{"prompt_token_ids": list(range(3, 3 + 5 * (i + 1)))} for i in range(num_prompts)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_second_engine_with_other_pool_and_batch_compiles_nothing(tiny_checkpoint):
    path = str(tiny_checkpoint(arch="llama"))
    graphs = counters["stats"]["unique_graphs"]
    first = LLM(model=path, dtype="float32", kv_cache_bytes=8 << 20)  # the default: compiled
    assert first.engine.executor.runner.decode_planner is not None
    assert [len(ids) for ids in _generate(first, 3)] == [6] * 3
    # The warm-up compiled the kernel, unless an earlier test of this process did: 1 or 0.
    by_first = counters["stats"]["unique_graphs"] - graphs
    assert by_first in (0, 1)

    second = LLM(model=path, dtype="float32", kv_cache_bytes=20 << 20)
    assert (first.engine.pool.num_blocks, second.engine.pool.num_blocks) == (512, 1280)
    assert [len(ids) for ids in _generate(second, 7)] == [6] * 7
    assert counters["stats"]["unique_graphs"] - graphs == by_first
