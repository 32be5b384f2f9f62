"""Sliding-window models equal transformers on sequences longer than their window: a Mistral
whose every layer slides over 24 tokens, and a Qwen2 whose first layer attends fully and second
slides (max_window_layers). Greedy tokens exactly; each chosen token's logprob against
transformers' full forward pass (no KV cache) over the same tokens.

Logprob tolerance: fp32 throughout; the two sides sum the same dot products in other orders,
a few ulps of logits of order 10: 1e-4 absolute. A window off by one token moves these logprobs
by 1e-2 or more on these checkpoints (attention weights are O(1) by the demo's init)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.model_executor.model_config import load_model_config

from hf_reference import hf_greedy, hf_model

MAX_NEW = 30


@pytest.fixture(scope="module")
def mistral(tiny_checkpoint):
    return tiny_checkpoint("mistral", sliding_window=24)


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoint):
    return tiny_checkpoint("qwen2", sliding_window=20, max_window_layers=1)


def prompts_for(tokenizer) -> list[list[int]]:
    """Prompts of 5 to ~70 tokens; the last two share a 48-token (three-block) prefix."""
    shared = tokenizer.encode("the quick brown fox jumps over the lazy dog and runs " * 8)[:48]
    texts = ["a much longer prompt about serving language models from a cluster of machines " * 3, "short one",
             "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts += [shared + tokenizer.encode(s) for s in ("alpha beta", "gamma delta epsilon")]
    return prompts


def generate(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def full_forward_logprobs(checkpoint, prompt: list[int], output: list[int]) -> list[float]:
    """transformers' logprob of each output token, from one forward pass over prompt + output."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(str(checkpoint))(input_ids=ids).logits[0].float()
    logprobs = logits[len(prompt) - 1:-1].log_softmax(-1)
    return logprobs.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def assert_equal_to_transformers(checkpoint, prompts, outs, what):
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref, _ = hf_greedy(str(checkpoint), tuple(prompt), MAX_NEW)
        assert out.token_ids == ref, f"{what}: prompt {i} ({len(prompt)} tokens)"
        ours = [lp.logprob for lp in out.logprobs]
        want = full_forward_logprobs(checkpoint, prompt, ref)
        assert ours == pytest.approx(want, abs=1e-4), f"{what}: prompt {i} logprobs"


def test_configs_give_each_layer_its_window(mistral, qwen2):
    cfg = load_model_config(str(mistral))
    assert cfg.sliding_windows == (24, 24) and cfg.kv_sliding_window == 24
    assert cfg.max_model_len == cfg.max_position_embeddings == 2048  # no longer capped at the window
    cfg = load_model_config(str(qwen2))
    assert cfg.sliding_windows == (None, 20) and cfg.kv_sliding_window is None


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cpu-decode-kernel", "twin"])
def test_mistral_past_its_window_matches_transformers(mistral, enforce_eager):
    llm = LLM(model=str(mistral), dtype="float32", kv_cache_bytes=32 << 20, enforce_eager=enforce_eager)
    prompts = prompts_for(llm.tokenizer)
    assert max(map(len, prompts)) > 2 * 24 and min(map(len, prompts)) < 24
    assert_equal_to_transformers(mistral, prompts, generate(llm, prompts), "batch")
    # Again, from the prefix cache: the hits cover blocks outside the window too.
    hits = llm.engine.stats().prefix_cache_hits
    assert_equal_to_transformers(mistral, prompts, generate(llm, prompts), "prefix-cached rerun")
    assert llm.engine.stats().prefix_cache_hits - hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_mistral_with_async_scheduling_matches_transformers(mistral):
    # The next step is scheduled (its blocks freed and allocated) while this one runs: the blocks
    # that leave the window then are ones no query of the running step reads either.
    llm = LLM(model=str(mistral), dtype="float32", kv_cache_bytes=32 << 20, async_output_proc=True,
              async_scheduling=True)
    assert llm.engine.async_scheduling
    prompts = prompts_for(llm.tokenizer)
    assert_equal_to_transformers(mistral, prompts, generate(llm, prompts), "async scheduling")
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_mistral_chunked_prefill_across_the_window(mistral):
    # 7-token chunks: chunks start before, inside and past each window.
    llm = LLM(model=str(mistral), dtype="float32", kv_cache_bytes=32 << 20, max_num_batched_tokens=7)
    prompts = prompts_for(llm.tokenizer)
    assert_equal_to_transformers(mistral, prompts, generate(llm, prompts), "chunked prefill")


def test_qwen2_with_full_and_sliding_layers_matches_transformers(qwen2):
    llm = LLM(model=str(qwen2), dtype="float32", kv_cache_bytes=32 << 20)
    prompts = prompts_for(llm.tokenizer)
    assert_equal_to_transformers(qwen2, prompts, generate(llm, prompts), "batch")
    assert_equal_to_transformers(qwen2, prompts, generate(llm, prompts), "prefix-cached rerun")


def test_mistral_preempted_and_parallel_samples_match_transformers(mistral):
    # 9 blocks cannot hold four 60..70-token sequences growing by 30: preemption by recompute; the
    # two samples of each request (n=2) share their parent's prompt blocks until the window
    # passes them.
    cfg = load_model_config(str(mistral))
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    llm = LLM(model=str(mistral), dtype="float32", kv_cache_bytes=9 * per_block, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    prompts = [p for p in prompts_for(llm.tokenizer) if len(p) > 24]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        ref, _ = hf_greedy(str(mistral), tuple(prompt), MAX_NEW)
        assert [o.token_ids for o in out.outputs] == [ref, ref]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks == 9


def test_mistral_on_triton_kernels_matches_transformers(mistral, monkeypatch):
    pytest.importorskip("triton")
    from pagefleet.kernels import ops
    from pagefleet.kernels.triton_kernel import TritonKernel

    launches = Counter()
    real_on = TritonKernel.on

    def counting_on(self, device):
        launches[self.__name__] += 1
        return real_on(self, device)

    monkeypatch.setattr(TritonKernel, "on", counting_on)
    monkeypatch.setenv(ops.ENV_VAR, "triton")  # the interpreter on CPU
    # 16-token steps: the 50-token prompts prefill in chunks that cross the 24-token window.
    llm = LLM(model=str(mistral), dtype="float32", device="cpu", kv_cache_bytes=4 << 20, max_num_batched_tokens=16)
    prompts = prompts_for(llm.tokenizer)[3:]  # the two 50-token prompts with a shared 48-token prefix
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
    second = llm.generate([{"prompt_token_ids": prompts[1]}], params)  # a 48-token prefix hit
    assert second[0].num_cached_tokens == 48
    for prompt, out in zip(prompts, first + second):
        assert out.outputs[0].token_ids == hf_greedy(str(mistral), tuple(prompt), 6)[0]
    assert launches["_paged_attention_kernel"] > 0
