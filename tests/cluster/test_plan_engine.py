"""``pagefleet plan`` against the engine itself: the pool a real start reports, and the
weights each tensor-parallel rank's modules hold."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pagefleet.cluster.cli import main
from pagefleet.kernels.ops import select_kernels
from pagefleet.worker import LLM
from pagefleet.worker.model_executor.model import LlamaForCausalLM
from pagefleet.worker.model_executor.model_config import ModelConfig, load_model_config
from pagefleet.worker.parallel.tp_group import TPGroup
from pagefleet.worker.simulated.checkpoint import write_config_checkpoint
from pagefleet.worker.simulated.presets import GPUS, find_model
from pagefleet.worker.simulated.sizing import ReplicaShape, size_gpu, weight_elements_per_rank


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("arch, dtype, budget", [("llama", "float32", 1_000_000), ("qwen3", "bfloat16", 300_000)])
def test_plan_pool_equals_a_real_engine_start(tiny_checkpoint, capsys, caplog, arch, dtype, budget):
    path = str(tiny_checkpoint(arch=arch, dtype=dtype))
    plan = plan_json(capsys, "--model", path, "--kv-cache-bytes", str(budget), "--max-model-len", "256",
                     "--input-len", "100", "--output-len", "20")
    with caplog.at_level(logging.INFO, logger="pagefleet.worker.engine.llm_engine"):
        llm = LLM(model=path, kv_cache_bytes=budget, max_model_len=256)
    stats = llm.engine.stats()
    assert plan["num_blocks"] == stats.num_total_blocks
    assert plan["num_tokens"] == stats.num_total_blocks * 16
    assert plan["kv_bytes_per_token_per_gpu"] * 16 == llm.engine.executor.kv_bytes_per_block(16)
    assert plan["weight_bytes_per_gpu"] == llm.engine.executor.runner.weight_bytes()
    started = [r.getMessage() for r in caplog.records if "KV cache (per rank)" in r.getMessage()]
    assert len(started) == 1
    assert f"of {plan['num_blocks']} blocks = {plan['num_tokens']} tokens" in started[0]
    assert f"max_model_len 256: {plan['max_concurrency_at_max_model_len']:.2f}x" in started[0]


def test_plan_refuses_what_the_engine_refuses(tiny_checkpoint, capsys):
    path = str(tiny_checkpoint(arch="llama"))
    # tiny llama, fp32: 1 KiB of KV per token, so 1 MiB holds 1024 tokens < its 2048-token limit
    with pytest.raises(ValueError) as engine_error:
        LLM(model=path, kv_cache_bytes=1 << 20)
    capsys.readouterr()  # the loader's progress bar
    assert main(["plan", "--model", path, "--kv-cache-bytes", "1MiB", "--input-len", "100"]) == 2
    assert capsys.readouterr().err.strip() == f"pagefleet plan: error: {engine_error.value}"


def _engine_weight_bytes_per_rank(name: str, tp: int) -> int:
    """Builds the engine's model for rank 0 of ``tp`` on the meta device (no memory) and sums
    its parameters, as ModelRunner.weight_bytes does."""
    m = find_model(name)
    cfg = ModelConfig(path=Path("."), architecture="LlamaForCausalLM", served_model_names=(m.name,),
                      vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                      num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                      head_dim=m.head_dim, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                      max_position_embeddings=16, max_model_len=16, tie_word_embeddings=m.tie_word_embeddings,
                      attention_bias=m.attention_bias, mlp_bias=m.mlp_bias, qk_norm=m.qk_norm,
                      dtype=torch.bfloat16, eos_token_ids=(0,))
    model = LlamaForCausalLM(cfg, TPGroup(rank=0, size=tp), select_kernels(torch.device("cpu")), device="meta")
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name, tp", [("llama-3-8b", 1), ("qwen2.5-7b", 2), ("qwen3-32b", 4),
                                      ("llama-3.1-405b", 16)])  # 405B: 8 KV heads replicated over 16
def test_plan_weights_per_rank_equal_the_engine_modules(name, tp):
    assert weight_elements_per_rank(find_model(name), tp) * 2 == _engine_weight_bytes_per_rank(name, tp)


@pytest.mark.parametrize("name, tp", [("qwen3-30b-a3b", 4), ("gpt-oss-20b", 4), ("mixtral-8x7b", 2)])
def test_plan_weights_per_rank_equal_the_engine_modules_for_experts(tmp_path, name, tp):
    """The MoE presets' config-only checkpoints, read by the engine and built for rank 0 on the meta
    device: the plan's bytes are its modules' (gpt-oss's sinks are float32, its other weights bf16)."""
    m = find_model(name)
    cfg = load_model_config(str(write_config_checkpoint(m, tmp_path / "ckpt")), max_model_len=16)
    assert (cfg.num_parameters, cfg.num_experts, len(cfg.moe_layers)) == (
        weight_elements_per_rank(m, 1), m.num_experts, m.num_layers)
    model = LlamaForCausalLM(cfg, TPGroup(rank=0, size=tp), select_kernels(torch.device("cpu")), device="meta")
    engine_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = ReplicaShape(m, GPUS["h200"], tp, "bfloat16", "bfloat16", 0.9, None, 16, 2048)
    assert size_gpu(shape).weight_bytes == engine_bytes


def test_plan_of_a_windowed_checkpoint_accepts_what_the_engine_accepts(tiny_checkpoint, capsys):
    """A tiny Mistral with a 32-token window in every layer: 2048 tokens of max_model_len do not fit
    in 64 blocks, but a sequence holds at most 31 + 256 + 16 tokens, so the engine starts and the
    plan sizes the same pool, counting each request's blocks that are still held."""
    path = str(tiny_checkpoint(arch="mistral", sliding_window=32))
    budget = 64 * 16 * 1024  # fp32 tiny Mistral: 1 KiB of KV a token
    plan = plan_json(capsys, "--model", path, "--kv-cache-bytes", str(budget), "--max-num-batched-tokens", "256",
                     "--input-len", "100", "--output-len", "20")
    llm = LLM(model=path, kv_cache_bytes=budget, max_num_batched_tokens=256)
    assert plan["kv_bytes_per_token_per_gpu"] == 1024
    assert plan["num_blocks"] == llm.engine.stats().num_total_blocks == 64
    assert (plan["kv_sliding_window"], plan["max_tokens_held_per_seq"]) == (32, 31 + 256 + 16)
    # 120 tokens: 8 blocks, of which (120 - 32) // 16 = 5 are given back
    assert plan["mean_blocks_per_request"] == 3
    assert plan["concurrent_requests_paged"] == 21
    assert (plan["concurrent_requests_contiguous"], plan["paged_over_contiguous"]) == (0, None)
