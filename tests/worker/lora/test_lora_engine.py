"""Batched LoRA: greedy output for each adapter equals transformers + PEFT on the same base and
adapter (exact, fp32, adapters with non-zero B), in one batch mixing three adapters and the base,
with prefix caching on; the adapter is part of the block hash."""

from __future__ import annotations

import pytest

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.block_hash import block_hashes, extra_keys_digest
from pagefleet.worker.lora.request import LoRARequest

from lora_helpers import ADAPTERS, peft_greedy, write_adapter

MAX_NEW = 10


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(base, root / name, *spec) for name, spec in ADAPTERS.items()}


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(adapters.items(), start=1)}


def _prompts(tokenizer) -> tuple[list[int], list[list[int]]]:
    shared = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)[:40]  # two full blocks
    others = [tokenizer.encode(t) for t in ("hi there", "one two three four five six seven",
                                            "serving language models from a cluster of machines " * 2)]
    return shared, others


def test_mixed_batch_of_three_adapters_and_the_base_equals_peft(base, adapters):
    llm = LLM(model=str(base), dtype="float32", kv_cache_bytes=32 << 20, enable_lora=True, max_loras=3,
              max_lora_rank=8)
    loras = _requests(adapters)
    shared, others = _prompts(llm.tokenizer)
    # The same two-block prompt under the base and each adapter, then other prompts, adapters interleaved.
    batch = [(shared, None), (shared, loras["sql"]), (shared, loras["chat"]), (shared, loras["code"]),
             (others[0], loras["chat"]), (others[1], None), (others[2], loras["sql"]), (others[0], loras["code"]),
             (others[2], None)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    refs = [peft_greedy(str(base), None if lora is None else str(adapters[lora.lora_name]), tuple(p), MAX_NEW)
            for p, lora in batch]
    # The adapters change the output: the shared prompt continues four different ways.
    assert len({tuple(r) for r in refs[:4]}) == 4

    def run():
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params,
                            lora_request=[lora for _, lora in batch])
        return [o.outputs[0].token_ids for o in outs]

    assert run() == refs
    stats = llm.engine.stats()
    # No prefix is shared across adapters or with the base: the shared prompt hit nothing.
    assert stats.prefix_cache_hits == 0
    hashes = [block_hashes(shared, 16, extra_keys_digest((), name)) for name in (None, "sql", "chat", "code")]
    assert len({h[0] for h in hashes}) == 4 and len({h[1] for h in hashes}) == 4
    assert all(h[0] in llm.engine.pool.cached and h[1] in llm.engine.pool.cached for h in hashes)
    # Again: each prompt is served from its own adapter's cached blocks, with the same output.
    assert run() == refs
    hits = llm.engine.stats().prefix_cache_hits
    assert hits == sum((len(p) - 1) // 16 * 16 for p, _ in batch)
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_total_blocks


def test_more_adapters_than_slots_wait_their_turn(base, adapters):
    """max_loras 1: three adapters and the base in one generate run one adapter at a time (the
    base beside any), each still equal to PEFT (a step naming two adapters would raise in the
    runner); one host slot means adapters are reread."""
    llm = LLM(model=str(base), dtype="float32", kv_cache_bytes=32 << 20, enable_lora=True, max_loras=1,
              max_lora_rank=8)
    loras = _requests(adapters)
    shared, others = _prompts(llm.tokenizer)
    batch = [(others[1], loras["sql"]), (others[1], loras["chat"]), (others[1], None), (others[1], loras["code"]),
             (others[0], loras["sql"])]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params,
                        lora_request=[lora for _, lora in batch])
    refs = [peft_greedy(str(base), None if lora is None else str(adapters[lora.lora_name]), tuple(p), MAX_NEW)
            for p, lora in batch]
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert len(llm.engine.executor.runner.lora_manager.slots) == 1
    assert len(llm.engine.executor.runner.lora_manager.host) == 1  # max_cpu_loras defaults to max_loras


@pytest.mark.parametrize("what, engine", [
    # 10 blocks of 16 tokens cannot hold the batch to its end: sequences are preempted and
    # recomputed, under their own adapters; a 7-token budget chunks every prompt.
    ("preemption and chunked prefill", dict(kv_cache_bytes=10 * 2 * 2 * 16 * 2 * 32 * 4, max_num_batched_tokens=7,
                                            enable_prefix_caching=False, max_model_len=128)),
    # A step launched before the last one's tokens reach the host keeps each row's adapter.
    ("async scheduling", dict(kv_cache_bytes=32 << 20, async_output_proc=True, async_scheduling=True)),
])
def test_adapters_survive_preemption_chunking_and_async_scheduling(base, adapters, what, engine):
    llm = LLM(model=str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, **engine)
    loras = _requests(adapters)
    shared, others = _prompts(llm.tokenizer)
    batch = [(shared, loras["sql"]), (others[2], loras["chat"]), (others[1], None), (shared, loras["code"]),
             (others[2], loras["sql"]), (others[0], None)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params, lora_request=[lora for _, lora in batch])
    refs = [peft_greedy(str(base), None if lora is None else str(adapters[lora.lora_name]), tuple(p), 24)
            for p, lora in batch]
    assert [o.outputs[0].token_ids for o in outs] == refs, what
    stats = llm.engine.stats()
    if what.startswith("preemption"):
        assert llm.engine.pool.num_blocks == 10 and stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_gpu_slots_are_reused_least_recently_used_first_and_never_from_the_step(base, adapters):
    llm = LLM(model=str(base), dtype="float32", kv_cache_bytes=16 << 20, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_cpu_loras=3)
    for request in _requests(adapters).values():
        llm.engine.add_lora(request)
    manager = llm.engine.executor.runner.lora_manager
    qkv = llm.engine.executor.runner.model.layers[0].self_attn.qkv_proj.lora

    def slots_after(*ids):
        mapping = manager.mapping(list(ids), list(range(len(ids) + 1)))
        return dict(manager.slots), mapping

    assert slots_after(1)[0] == {1: 0}
    assert slots_after(2, None)[0] == {1: 0, 2: 1}
    slots, mapping = slots_after(3, None, 2)  # 1 is the least recently used: 3 takes its slot
    assert slots == {2: 1, 3: 0}
    assert mapping.rows.tolist() == [0, 2] and mapping.segments == [(0, 0, 1), (1, 1, 2)]
    # code: lora_alpha / r; chat: rsLoRA's lora_alpha / sqrt(r) (fp32)
    assert mapping.scalings.flatten().tolist() == pytest.approx([4 / 2, 16 / 8 ** 0.5], rel=1e-7)
    assert slots_after(1, 3)[0] == {3: 0, 1: 1}  # 2 goes, not 3, which this step uses too
    with pytest.raises(ValueError, match="a step names 3 LoRA adapters; max_loras is 2"):
        manager.mapping([1, 2, 3], [0, 1, 2, 3])
    assert manager.remove_lora(1) and not manager.remove_lora(1)
    assert qkv.scalings[1] is None and not qkv.lora_a[1].any() and not qkv.lora_b[1].any()
    assert list(manager.slots) == [3] and 1 not in manager.host


def test_an_adapter_is_removed_only_when_no_request_holds_it(base, adapters, tmp_path):
    llm = LLM(model=str(base), dtype="float32", kv_cache_bytes=16 << 20, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    loras = _requests(adapters)
    ids = llm.tokenizer.encode("one two three four five six seven")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.engine.add_request("held", ids, params, lora_request=loras["sql"])
    assert 1 in llm.engine.executor.runner.lora_manager.known  # so the check after removal means something
    with pytest.raises(ValueError, match=r"LoRA adapter 'sql' is in use by 1 request\(s\), e.g. 'held'"):
        llm.engine.remove_lora(1)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.remove_lora(1) and not llm.engine.remove_lora(1)
    assert llm.engine.list_loras() == []
    assert 1 not in llm.engine.executor.runner.lora_manager.known
    # The name keeps its weights for the engine's life (cached blocks are keyed by it) ...
    with pytest.raises(ValueError, match=r"LoRA adapter 'sql' was served from .*; its name cannot name"):
        llm.engine.add_lora(LoRARequest("sql", 7, str(adapters["chat"])))
    # ... and comes back under a new id, equal to PEFT again.
    again = LoRARequest("sql", 7, str(adapters["sql"]))
    out = llm.generate({"prompt_token_ids": ids}, params, lora_request=again)
    assert out[0].outputs[0].token_ids == peft_greedy(str(base), str(adapters["sql"]), tuple(ids), 4)
    assert llm.engine.list_loras() == [again]
