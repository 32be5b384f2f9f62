"""Greedy tokens from pagefleet equal transformers' on tiny checkpoints of all seven
architectures (the three mixture-of-experts ones included), under prefix sharing, forced preemption and forced chunking.

By default (no enforce_eager) decode rows read their KV blocks in place through the compiled
C++ decode attention kernel, so every case below runs that way; the Llama batch, prefix-cache,
preemption and chunked-prefill cases run again with enforce_eager (the twin's attention), with
the same exact checks.

Every case here asserts exact equality: on these fp32 checkpoints no near-tie flips under
a different batch composition, chunk split or recompute, so the DESIGN.md top-5
criterion (tests/hf_reference.assert_greedy_close) is not needed; the TP tests use it,
where a different all-reduce order changes fp32 sums."""

from __future__ import annotations

import pytest

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.model_executor.model_config import load_model_config

from hf_reference import hf_greedy

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "gpt_oss"]
MAX_NEW = 12


def prompts_for(tokenizer) -> list[list[int]]:
    """Eight prompts of different lengths (3..~100 tokens); four share a 2-block prefix."""
    shared = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)[:40]
    texts = ["hi there", "one two three four five six seven eight nine ten",
             "a much longer prompt about serving language models from a cluster of machines " * 2,
             "short"]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts += [shared + tokenizer.encode(s) for s in ("alpha", "beta gamma", "delta epsilon zeta", "eta")]
    return prompts


def run(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(arch=request.param)


def reference(checkpoint, prompts, max_new: int = MAX_NEW):
    return [hf_greedy(str(checkpoint), tuple(p), max_new) for p in prompts]


def assert_equal_to_reference(outs, refs, what):
    for i, (out, (ref_ids, _)) in enumerate(zip(outs, refs)):
        assert out.finish_reason == "length"
        assert out.token_ids == ref_ids, f"{what}: prompt {i}"


def test_batch_matches_transformers(checkpoint):
    check_batch_and_prefix_cached_rerun(LLM(model=str(checkpoint), dtype="float32", kv_cache_bytes=32 << 20),
                                        checkpoint)


def check_batch_and_prefix_cached_rerun(llm, checkpoint):
    prompts = prompts_for(llm.tokenizer)
    assert len(set(map(len, prompts))) == len(prompts)  # all lengths differ
    refs = reference(checkpoint, prompts)
    assert_equal_to_reference(run(llm, prompts), refs, "batch")
    # The same prompts again are served from the prefix cache and must not change.
    hits_before = llm.engine.stats().prefix_cache_hits
    assert_equal_to_reference(run(llm, prompts), refs, "prefix-cached rerun")
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits - hits_before >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_shared_prefix_hits_within_one_batch(checkpoint):
    llm = LLM(model=str(checkpoint), dtype="float32", kv_cache_bytes=32 << 20)
    prompts = prompts_for(llm.tokenizer)
    assert_equal_to_reference(run(llm, prompts), reference(checkpoint, prompts), "shared prefix")
    # Prompts 5..7 reuse the two full blocks prompt 4 stored in the same step.
    assert llm.engine.stats().prefix_cache_hits == 3 * 32


def test_prefix_caching_off_matches(checkpoint):
    llm = LLM(model=str(checkpoint), dtype="float32", kv_cache_bytes=32 << 20, enable_prefix_caching=False)
    prompts = prompts_for(llm.tokenizer)
    assert_equal_to_reference(run(llm, prompts), reference(checkpoint, prompts), "no prefix caching")
    assert llm.engine.stats().prefix_cache_hits == 0


def test_preemption_matches(checkpoint):
    check_preemption(checkpoint)


def check_preemption(checkpoint, **kw):
    # 8 blocks of 16 tokens cannot hold all eight sequences (~27 blocks at the end): running
    # sequences crossing block boundaries force preemption by recompute, and recomputed
    # sequences must continue identically.
    cfg = load_model_config(str(checkpoint))
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    llm = LLM(model=str(checkpoint), dtype="float32", block_size=16, enable_prefix_caching=False,
              kv_cache_bytes=8 * per_block, max_model_len=128, **kw)
    assert llm.engine.pool.num_blocks == 8
    prompts = prompts_for(llm.tokenizer)
    assert_equal_to_reference(run(llm, prompts, 24), reference(checkpoint, prompts, 24), "preemption")
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == 8


def test_chunked_prefill_matches(checkpoint):
    # A 7-token budget chunks every prompt longer than 7 tokens across steps.
    check_chunked_prefill(LLM(model=str(checkpoint), dtype="float32", kv_cache_bytes=32 << 20,
                              max_num_batched_tokens=7), checkpoint)


def check_chunked_prefill(llm, checkpoint):
    prompts = prompts_for(llm.tokenizer)
    assert_equal_to_reference(run(llm, prompts), reference(checkpoint, prompts), "chunked prefill")
    budget = llm.engine.args.max_num_batched_tokens
    assert llm.engine.stats().num_steps > max(map(len, prompts)) // budget


# ---- which attention ran: the compiled decode attention by default, the twin with enforce_eager.
# One build serves every pool and batch size, so these share the kernel of the tests above.


@pytest.fixture(scope="module")
def llama_checkpoint(tiny_checkpoint):
    return tiny_checkpoint(arch="llama")


@pytest.fixture
def decode_calls(monkeypatch):
    """How many rows each call of the compiled decode attention had (one call per layer per step
    with decode rows)."""
    from pagefleet.kernels.cpu import decode_attention as cpu_decode_attention

    calls = []
    real = cpu_decode_attention.decode_attention

    def counted(query, key_cache, value_cache, plan, *rest):
        calls.append(plan.seq_lens.numel())
        return real(query, key_cache, value_cache, plan, *rest)

    monkeypatch.setattr(cpu_decode_attention, "decode_attention", counted)
    return calls


def test_compiled_batch_matches_transformers(llama_checkpoint, decode_calls):
    llm = LLM(model=str(llama_checkpoint), dtype="float32", kv_cache_bytes=32 << 20)
    assert llm.engine.executor.runner.compiled_kernels
    check_batch_and_prefix_cached_rerun(llm, llama_checkpoint)
    # Two runs of eight prompts, 11 decode steps each after the prompt step, every layer.
    layers = load_model_config(str(llama_checkpoint)).num_layers
    assert decode_calls == [8] * (2 * (MAX_NEW - 1) * layers)


def test_compiled_chunked_prefill_matches(llama_checkpoint, decode_calls):
    # 7-token steps: decode rows share steps with prefill chunks, which the twin serves.
    llm = LLM(model=str(llama_checkpoint), dtype="float32", kv_cache_bytes=32 << 20, max_num_batched_tokens=7)
    check_chunked_prefill(llm, llama_checkpoint)
    assert decode_calls and max(decode_calls) > 1


def test_eager_batch_matches_transformers(llama_checkpoint, decode_calls):
    llm = LLM(model=str(llama_checkpoint), dtype="float32", kv_cache_bytes=32 << 20, enforce_eager=True)
    assert llm.engine.executor.runner.compiled_kernels is False
    check_batch_and_prefix_cached_rerun(llm, llama_checkpoint)
    assert decode_calls == []


def test_eager_preemption_matches(llama_checkpoint, decode_calls):
    check_preemption(llama_checkpoint, enforce_eager=True)
    assert decode_calls == []


def test_eager_chunked_prefill_matches(llama_checkpoint, decode_calls):
    check_chunked_prefill(LLM(model=str(llama_checkpoint), dtype="float32", kv_cache_bytes=32 << 20,
                              max_num_batched_tokens=7, enforce_eager=True), llama_checkpoint)
    assert decode_calls == []


def test_priority_preemption_matches(llama_checkpoint):
    """--scheduling-policy priority with 8 blocks: the four worst-priority prompts arrive first
    and run first, the four better ones six steps later, so blocks run short while the worst are
    scheduled ahead of the better ones in the step. The victims (the worst, taken out of the step
    they were scheduled in; low0's token there completed its first block, whose hash is withdrawn)
    recompute identically."""
    cfg = load_model_config(str(llama_checkpoint))
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    llm = LLM(model=str(llama_checkpoint), dtype="float32", block_size=16, kv_cache_bytes=8 * per_block,
              max_model_len=128, scheduling_policy="priority")
    engine = llm.engine
    withdrawn: list[tuple[str, int]] = []  # (request, blocks its step allocation had published)
    withdraw = engine.kv.withdraw_step

    def spy(seq):
        withdrawn.append((seq.request_id, sum(sid == seq.seq_id for sid, _ in engine.kv._step_published)))
        withdraw(seq)

    engine.kv.withdraw_step = spy
    prompts = prompts_for(llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    names = [f"low{i}" for i in range(4)] + [f"high{i}" for i in range(4)]
    tokens: dict[str, list[int]] = {name: [] for name in names}
    for name, prompt in zip(names[:4], prompts[:4]):
        engine.add_request(name, prompt, params, priority=9)
    for step in range(10_000):
        if step == 6:
            for name, prompt in zip(names[4:], prompts[4:]):
                engine.add_request(name, prompt, params, priority=0)
        for delta in engine.step():
            tokens[delta.request_id] += [t for s in delta.sequences for t in s.token_ids]
        if step >= 6 and not engine.has_unfinished():
            break
    refs = reference(llama_checkpoint, prompts, 24)
    assert [tokens[name] for name in names] == [ref_ids for ref_ids, _ in refs]
    assert withdrawn == [("low1", 0), ("low0", 1)]  # only the worst were taken out of a step
    stats = engine.stats()
    assert (stats.num_preemptions, stats.num_free_blocks) == (5, 8)
