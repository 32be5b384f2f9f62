"""`kv_cache_dtype="fp8"`: an e4m3 KV cache on the CPU engine, through the real loader.

The fp8 engine holds twice the blocks of the bf16 one in the same byte budget, generates, and its
next-token logits stay close to the bf16 engine's at every prompt position (all of them read K/V
back from the cache: each prompt runs as one prefill step whose attention reads the blocks it
just wrote). A simulated GPU and `pagefleet plan` count the same 1 byte per element.
"""

from __future__ import annotations

import pytest
import torch

from pagefleet.cluster.plan.capacity import make_plan
from pagefleet.cluster.plan.cli import PlanArgs, plan_inputs
from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.engine.llm_engine import LLMEngine
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.model_executor.model_config import load_model_config
from pagefleet.worker.model_executor.model_runner import StepInput

KV_CACHE_BYTES = 3 << 20  # not a multiple of a bf16 block: the block counts come from a floor
PROMPTS = ["the quick brown fox jumps over the lazy dog",
           "a much longer prompt about serving language models from a cluster of machines " * 3,
           "one two three four five six seven eight nine ten", "short"]
# Measured 0.9998 (worst position over these prompts) on the tiny random-weight Llama; 0.99 is
# the bar, so a broken scale or a garbled block (cosine far below 0.9) cannot pass.
MIN_COSINE = 0.99


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    common = dict(model=path, dtype="bfloat16", kv_cache_bytes=KV_CACHE_BYTES, max_model_len=256)
    bf16, fp8 = LLM(**common), LLM(**common, kv_cache_dtype="fp8")
    yield bf16, fp8
    bf16.shutdown()
    fp8.shutdown()


def _prompt_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """[n, vocab] fp32 next-token logits at every position of one prompt, run as one prefill step
    over blocks 0.. of the engine's own cache (nothing else is running)."""
    runner = llm.engine.executor.runner
    n, bs = len(token_ids), llm.engine.args.block_size
    step = StepInput(input_ids=token_ids, positions=list(range(n)), slot_mapping=list(range(n)),
                     block_tables=[list(range(-(-n // bs)))], query_start_loc=[0, n], seq_lens=[n],
                     logits_indices=list(range(n)))
    return runner.execute(step)


def test_fp8_pool_holds_twice_the_blocks_in_the_same_budget(engines, tiny_checkpoint):
    bf16, fp8 = engines
    cfg = load_model_config(str(tiny_checkpoint("llama")))
    bf16_block = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * 16  # K and V, 2 bytes, 16 tokens
    assert bf16.engine.executor.kv_bytes_per_block(16) == bf16_block
    assert fp8.engine.executor.kv_bytes_per_block(16) == bf16_block // 2
    assert bf16.engine.pool.num_blocks == KV_CACHE_BYTES // bf16_block
    assert fp8.engine.pool.num_blocks == KV_CACHE_BYTES // (bf16_block // 2) == 2 * bf16.engine.pool.num_blocks
    key_cache, value_cache = fp8.engine.executor.runner.kv_caches[0]
    assert key_cache.dtype == value_cache.dtype == torch.float8_e4m3fn
    assert key_cache.shape[0] == fp8.engine.pool.num_blocks
    assert bf16.engine.executor.runner.kv_caches[0][0].dtype == torch.bfloat16


def test_fp8_cpu_engine_runs_attention_in_the_twin(engines):
    bf16, fp8 = engines
    # The C++ decode attention reads 16/32-bit blocks only: the fp8 engine keeps the fused norms
    # and rotary and attends in the PyTorch twin.
    assert str(bf16.engine.executor.runner.kernels) == "torch with the C++ decode attention, norms and rotary"
    assert str(fp8.engine.executor.runner.kernels) == "torch with the C++ norms and rotary"


def test_fp8_logits_stay_close_to_bf16_at_every_prompt_position(engines):
    bf16, fp8 = engines
    worst = 1.0
    positions = 0
    for text in PROMPTS:
        ids = bf16.tokenizer.encode(text)
        want, got = _prompt_logits(bf16, ids), _prompt_logits(fp8, ids)
        assert got.shape == want.shape == (len(ids), want.shape[1]) and torch.isfinite(got).all()
        cosine = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
        worst = min(worst, cosine.min().item())
        positions += len(ids)
    print(f"fp8 vs bf16 KV cache: worst next-token logit cosine {worst:.5f} over {positions} positions")
    assert positions > 40
    assert worst >= MIN_COSINE


def test_fp8_engine_generates(engines):
    bf16, fp8 = engines
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": bf16.tokenizer.encode(t)} for t in PROMPTS]
    outs = [o.outputs[0] for o in fp8.generate(prompts, params)]
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
    assert [len(o.token_ids) for o in outs] == [16] * len(PROMPTS)
    # Every generated token's K/V went into and came back out of the fp8 cache; the decode steps
    # need not pick bf16's tokens (near-ties on random weights), so only their count is exact here.


def test_a_simulated_gpu_counts_fp8_at_one_byte_as_the_plan_does():
    auto = LLMEngine(EngineArgs(model="llama-3-8b", simulate="h200", kv_cache_bytes=1 << 30))
    fp8 = LLMEngine(EngineArgs(model="llama-3-8b", simulate="h200", kv_cache_bytes=1 << 30, kv_cache_dtype="fp8"))
    try:
        # Llama-3-8B: 32 layers x 8 KV heads x 128 x K,V x 16 tokens = 2 MiB of bf16 a block.
        assert auto.executor.kv_bytes_per_block(16) == 2 << 20
        assert fp8.executor.kv_bytes_per_block(16) == 1 << 20
        assert (auto.pool.num_blocks, fp8.pool.num_blocks) == (512, 1024)
        plan = make_plan(plan_inputs(PlanArgs(model="llama-3-8b", gpu="h200", kv_cache_dtype="fp8"),
                                     EngineArgs(model="llama-3-8b", kv_cache_bytes=1 << 30)))
        assert plan.num_blocks == fp8.pool.num_blocks
    finally:
        auto.shutdown()
        fp8.shutdown()


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp8_e5m2")
    assert EngineArgs(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
