"""The engine after things go wrong: a failed step, a pool too small for max_model_len."""

from __future__ import annotations

import pytest

from pagefleet.worker import LLM, SamplingParams


def test_failed_step_withdraws_the_prefix_hashes_it_published(tiny_checkpoint):
    path = str(tiny_checkpoint(arch="llama"))
    llm = LLM(model=path, dtype="float32", kv_cache_bytes=16 << 20)
    ids = llm.tokenizer.encode("a prompt long enough for three full blocks of cache " * 3)[:48]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    runner = llm.engine.executor
    real = runner.execute

    def fail(step):
        raise KeyboardInterrupt  # e.g. Ctrl-C in a notebook, mid-forward

    runner.execute = fail
    with pytest.raises(KeyboardInterrupt):
        llm.generate({"prompt_token_ids": ids}, params)
    runner.execute = real
    assert llm.engine.pool.cached == {}  # nothing claims KV that was never written
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    again = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert again.num_cached_tokens == 0
    fresh = LLM(model=path, dtype="float32", kv_cache_bytes=16 << 20).generate({"prompt_token_ids": ids}, params)[0]
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert [lp.logprob for lp in again.outputs[0].logprobs] == [lp.logprob for lp in fresh.outputs[0].logprobs]


def test_pool_smaller_than_max_model_len_is_refused_at_start(tiny_checkpoint):
    path = str(tiny_checkpoint(arch="llama"))
    # tiny llama: 2 layers x 2 KV heads x 32 dims x fp32, K and V: 1 KiB per token.
    with pytest.raises(ValueError, match="max_model_len 2048 is larger than the 1024 tokens"):
        LLM(model=path, dtype="float32", kv_cache_bytes=1 << 20)
    llm = LLM(model=path, dtype="float32", kv_cache_bytes=1 << 20, max_model_len=1024)
    assert llm.engine.pool.num_blocks == 64


def test_bad_kernel_switch_stops_the_start(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("PAGEFLEET_KERNELS", "bogus")
    with pytest.raises(ValueError, match="PAGEFLEET_KERNELS='bogus'"):
        LLM(model=str(tiny_checkpoint(arch="llama")), dtype="float32", kv_cache_bytes=16 << 20)


def test_a_bad_prompt_in_a_batch_leaves_no_request_behind(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint(arch="llama")), dtype="float32", kv_cache_bytes=16 << 20)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": []}], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 3
