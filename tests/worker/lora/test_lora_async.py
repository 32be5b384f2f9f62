"""The served path: AsyncLLMEngine takes a request's adapter by its --lora-modules name and streams
what transformers + PEFT generate; a name no worker holds is refused before anything is queued."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams
from pagefleet.worker.lora.request import LoRAModulePath
from pagefleet.worker.request_check import InvalidRequest

from lora_helpers import ADAPTERS, peft_greedy, write_adapter


def test_streams_by_adapter_name_equal_peft(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("llama")
    paths = {name: write_adapter(base, tmp_path / name, *ADAPTERS[name]) for name in ("sql", "code")}
    engine = AsyncLLMEngine(EngineArgs(model=str(base), dtype="float32", kv_cache_bytes=16 << 20, enable_lora=True,
                                       max_loras=2, max_lora_rank=8,
                                       lora_modules=[LoRAModulePath(n, str(p)) for n, p in paths.items()]))
    try:
        ids = engine.tokenizer.encode("one two three four five six seven")
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

        async def tokens(rid, lora_name):
            return [t async for d in engine.generate(rid, ids, params, lora_name=lora_name)
                    for t in d.sequences[0].token_ids]

        async def main():
            return await asyncio.gather(tokens("a", "sql"), tokens("b", None), tokens("c", "code"))

        got = asyncio.run(main())
        want = [peft_greedy(str(base), None if n is None else str(paths[n]), tuple(ids), 8)
                for n in ("sql", None, "code")]
        assert got == want
        with pytest.raises(InvalidRequest, match="no LoRA adapter named 'law' is loaded on this worker"):
            asyncio.run(tokens("d", "law"))
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    finally:
        engine.shutdown()
