"""LoRA at TP=2 (Ray actors on CPU, gloo): adapters shard as their base layers (B's output rows
of column-parallel q/k/v and gate/up, a replicated KV head's rows on both ranks; A's input
columns of row-parallel o/down), registered on every rank over the step wire, and a batch
mixing three adapters and the base equals transformers + PEFT (DESIGN.md's criterion: the
all-reduce sums in another order)."""

from __future__ import annotations

import pytest

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.lora.request import LoRAModulePath, LoRARequest
from pagefleet.worker.parallel.tp_executor import TPExecutor

from hf_reference import assert_greedy_close
from lora_helpers import ADAPTERS, peft_greedy_top5, write_adapter

MAX_NEW = 10


@pytest.fixture(scope="module")
def ray_session():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, ignore_reinit_error=True)
    yield
    if started:
        ray.shutdown()


def test_tp2_mixed_adapters_equal_peft(ray_session, tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("llama", num_key_value_heads=1)  # one KV head: replicated on both ranks
    paths = {name: write_adapter(base, tmp_path / name, *spec) for name, spec in ADAPTERS.items()}
    modules = [LoRAModulePath(name, str(path)) for name, path in paths.items()]
    llm = LLM(model=str(base), dtype="float32", kv_cache_bytes=16 << 20, tensor_parallel_size=2, enable_lora=True,
              max_loras=3, max_lora_rank=8, lora_modules=modules[:2])
    try:
        assert isinstance(llm.engine.executor, TPExecutor)
        loras = {r.lora_name: r for r in llm.engine.loras.values()}
        loras["code"] = LoRARequest("code", 3, str(paths["code"]))  # registered on first use, mid-run
        shared = llm.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)[:40]
        other = llm.tokenizer.encode("one two three four five six seven")
        batch = [(shared, None), (shared, loras["sql"]), (shared, loras["chat"]), (other, loras["code"]),
                 (other, None), (other, loras["chat"])]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params,
                            lora_request=[lora for _, lora in batch])
        for i, ((prompt, lora), out) in enumerate(zip(batch, outs)):
            ref, ref_top5 = peft_greedy_top5(str(base), None if lora is None else str(paths[lora.lora_name]),
                                             tuple(prompt), MAX_NEW)
            seq = out.outputs[0]
            assert_greedy_close(seq.token_ids, [{t for t, _ in lp.top} for lp in seq.logprobs], ref, ref_top5,
                                f"prompt {i} ({None if lora is None else lora.lora_name})")
        assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3  # the adapters steer the output
        # Removed on every rank over the step wire; the group steps on with the others.
        assert llm.engine.remove_lora(3) and [r.lora_name for r in llm.engine.list_loras()] == ["sql", "chat"]
        again = llm.generate({"prompt_token_ids": other}, params, lora_request=loras["chat"])[0].outputs[0]
        assert again.token_ids == outs[5].outputs[0].token_ids
    finally:
        llm.engine.shutdown()
