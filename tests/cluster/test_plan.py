"""``pagefleet plan``'s arithmetic against hand calculations (no torch, no Ray)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from pagefleet.cluster.cli import main
from pagefleet.cluster.plan.capacity import CostInputs, Lengths, PlanInputs, make_plan, mean_blocks_per_request
from pagefleet.worker.core.kv_cache_sizing import kv_heads_per_rank, size_kv_pool
from pagefleet.worker.simulated.presets import GPUS, MODELS, find_model
from pagefleet.worker.simulated.roofline import StepCost, StepRoofline, StepWork, decode_work, step_work

GiB = 2**30


def inputs(model: str, gpu: str | None = "h200", tp: int = 1, **kw) -> PlanInputs:
    m = find_model(model)
    base = dict(model=m, gpu=GPUS[gpu] if gpu else None, num_gpus=tp, tensor_parallel_size=tp, dtype="bfloat16",
                kv_cache_dtype="bfloat16", gpu_memory_utilization=0.9, kv_cache_bytes=None,
                max_model_len=m.max_position_embeddings, block_size=16, max_num_seqs=64,
                max_num_batched_tokens=2048, lengths=Lengths(1024, 128))
    base.update(kw)
    return PlanInputs(**base)


def test_llama_3_8b_on_h200_kv_per_token_and_single_stream_roofline():
    plan = make_plan(inputs("llama-3-8b"))
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert plan.kv_bytes_per_token_per_gpu == 2 * 32 * 8 * 128 * 2 == 131_072
    # embedding + LM head (untied): 2 x 128256 x 4096; per layer: q 4096x4096, k and v 4096x1024,
    # o 4096x4096, gate/up/down 3 x 4096x14336, two norms of 4096; final norm 4096
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    params = 2 * 128256 * 4096 + 32 * layer + 4096
    assert plan.num_params == params == 8_030_261_248
    assert plan.weight_bytes_per_gpu == 2 * params
    # one decode step reads every weight but the embedding table, plus the KV of its
    # 1024 + 128 / 2 = 1088-token mean context
    read = 2 * params - 2 * 128256 * 4096 + 1088 * 131_072
    single = plan.decode[0]
    assert (single.batch, single.bytes_read, single.bound) == (1, read, "memory")
    assert single.ms == pytest.approx(read / 4.8e12 * 1e3, rel=1e-12)
    assert 3.15 < single.ms < 3.16
    # reading the embedding table too would be the all-weights rule of thumb, 3.35 ms
    assert 2 * params / 4.8e12 * 1e3 == pytest.approx(3.346, abs=1e-3)


def test_qwen2_5_7b_gqa_with_biases_split_over_two_gpus():
    plan = make_plan(inputs("qwen2.5-7b", tp=2))
    # 28 query heads and 4 KV heads: 14 and 2 per rank
    assert kv_heads_per_rank(28, 4, 2) == 2
    assert plan.kv_bytes_per_token_per_gpu == 2 * 28 * 2 * 128 * 2 == 28_672
    assert plan.kv_bytes_per_token_per_replica == 57_344
    h, d, inter = 3584, 128, 18944 // 2
    qkv = (14 + 2 + 2) * d
    layer = h * qkv + qkv + 14 * d * h + 3 * h * inter + 2 * h  # q/k/v biases
    vocab_rows = 152064 // 2
    assert plan.weight_bytes_per_gpu == 2 * (28 * layer + 2 * vocab_rows * h + h)


def test_llama_3_70b_on_sixteen_gpus_replicates_its_eight_kv_heads():
    plan = make_plan(inputs("llama-3-70b", gpu="h100", tp=16))
    # 8 KV heads over 16 ranks: each rank keeps one (two ranks share each head)
    assert kv_heads_per_rank(64, 8, 16) == 1
    assert plan.kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2 == 40_960
    # the replica stores 16 heads' worth: twice the model's 2 x 80 x 8 x 128 x 2
    assert plan.kv_bytes_per_token_per_replica == 655_360 == 2 * 327_680
    h, d = 8192, 128
    layer = h * (4 + 1 + 1) * d + 4 * d * h + 3 * h * (28672 // 16) + 2 * h
    assert plan.weight_bytes_per_gpu == 2 * (80 * layer + 2 * (128256 // 16) * h + h)


def test_gpu_budget_is_memory_times_utilization_less_the_estimated_peak():
    p = inputs("llama-3-8b", gpu="h100", max_model_len=8192, max_num_batched_tokens=2048)
    plan = make_plan(p)
    weights = 2 * 8_030_261_248
    rotary = 8192 * 128 * 4
    activations = 2048 * (2 * 4096 + 3 * 14336) * 2
    scratch_kv = 2048 * 131_072
    assert plan.peak_estimate_bytes == weights + rotary + activations + scratch_kv
    budget = int(81559 * 2**20 * 0.9) - plan.peak_estimate_bytes
    assert plan.kv_budget_bytes_per_gpu == budget
    assert plan.num_blocks == budget // (16 * 131_072)
    assert plan.num_tokens == 16 * plan.num_blocks
    assert plan.max_concurrency_at_max_model_len == plan.num_tokens / 8192


def test_explicit_kv_budget_and_the_engines_refusal():
    plan = make_plan(inputs("llama-3-8b", kv_cache_bytes=10 * GiB, max_model_len=8192))
    assert plan.kv_budget_source == "kv_cache_bytes" and plan.peak_estimate_bytes is None
    assert plan.num_blocks == 10 * GiB // (16 * 131_072) == 5120
    assert plan.concurrent_requests_contiguous == 5120 * 16 // 8192 == 10
    # 1024 + 128 tokens = 72 blocks each: 5120 // 72 = 71 requests at full length
    assert plan.mean_blocks_per_request == 72
    assert plan.concurrent_requests_paged == 71
    assert plan.paged_over_contiguous == pytest.approx(7.1)
    with pytest.raises(ValueError, match="max_model_len 8192 is larger than the 4096 tokens"):
        make_plan(inputs("llama-3-8b", kv_cache_bytes=512 * 2**20, max_model_len=8192))
    with pytest.raises(ValueError, match="max_model_len 8192 is larger than the 4096 tokens"):
        size_kv_pool(512 * 2**20, 16 * 131_072, 16, 8192)  # the function the engine calls


def test_mean_blocks_per_request_equals_brute_force_over_the_length_ranges():
    lengths = Lengths(10, 4, 0.5)  # prompts 5..15, outputs 2..6
    brute = [math.ceil((p + o) / 16) for p in range(5, 16) for o in range(2, 7)]
    assert mean_blocks_per_request(lengths, 16) == pytest.approx(sum(brute) / len(brute), rel=1e-12)
    lengths = Lengths(1000, 300, 0.3)  # prompts 700..1300, outputs 210..390
    brute = [math.ceil((p + o) / 32) for p in range(700, 1301) for o in range(210, 391)]
    assert mean_blocks_per_request(lengths, 32) == pytest.approx(sum(brute) / len(brute), rel=1e-12)


def test_roofline_turns_compute_bound_at_the_exact_batch():
    # Short contexts make the KV reads small, so the weight reads stop dominating.
    plan = make_plan(inputs("llama-3-8b", lengths=Lengths(16, 16), max_num_seqs=1024))
    first = plan.compute_bound_from_batch
    assert first is not None and plan.decode[-1].bound == "compute"
    assert all(s.bound == "memory" for s in plan.decode[:-1])
    assert [s.batch for s in plan.decode[:-1]] == [2**i for i in range(len(plan.decode) - 1)]
    weights = 2 * 8_030_261_248 - 2 * 128256 * 4096
    ctx = 16 + 16 / 2
    matmul = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336) + 128256 * 4096
    flops = 2 * matmul + 4 * ctx * 32 * 128 * 32

    def compute_bound(b):
        return b * flops / 989e12 > (weights + b * ctx * 131_072) / 4.8e12

    assert compute_bound(first) and not compute_bound(first - 1)


def test_cost_from_the_roofline():
    cost = CostInputs(gpu_hour_price=2.0, requests_per_day=1_000_000, mean_prompt_tokens=1000,
                      mean_output_tokens=200, reasoning_multiplier=2.0)
    plan = make_plan(inputs("llama-3-8b", kv_cache_bytes=10 * GiB, max_model_len=8192, cost=cost))
    c = plan.cost
    # 1000 + 400 generated tokens = 88 blocks; 5120 // 88 = 58 requests fit, under max_num_seqs 64
    assert c.operating_batch == 58
    matmul = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336) + 128256 * 4096
    # compute-bound: each of the 1000 prompt tokens attends to itself and those before it
    assert c.prefill_s_per_request == pytest.approx((2 * matmul * 1000 + 4 * (1000 * 1001 // 2) * 32 * 128 * 32)
                                                    / 989e12, rel=1e-12)
    weights = 2 * 8_030_261_248 - 2 * 128256 * 4096
    step_s = (weights + 58 * (1000 + 200) * 131_072) / 4.8e12
    assert c.decode_s_per_request == pytest.approx(400 * step_s / 58)
    rps = 1 / (c.prefill_s_per_request + c.decode_s_per_request)
    assert c.requests_per_s_per_replica == pytest.approx(rps)
    assert c.gpus_needed == math.ceil(1_000_000 / 86400 / rps)
    assert c.monthly_cost == pytest.approx(c.gpus_needed * 2.0 * 730)
    tokens_month = 1_000_000 * 1200 * 730 / 24
    assert c.cost_per_million_tokens == pytest.approx(c.monthly_cost / tokens_month * 1e6)


def test_presets_have_their_published_parameter_counts():
    published = {"llama-3-8b": 8.03, "llama-3-70b": 70.55, "llama-3.1-405b": 405.85, "qwen2.5-7b": 7.62,
                 "qwen2.5-72b": 72.71, "qwen3-8b": 8.19, "qwen3-32b": 32.76, "mistral-7b-v0.3": 7.25}
    for name, billions in published.items():
        assert make_plan(inputs(name, gpu=None, kv_cache_bytes=64 * GiB, max_model_len=4096)).num_params / 1e9 \
            == pytest.approx(billions, abs=0.006), name
    assert find_model("meta-llama/Meta-Llama-3-8B-Instruct") is MODELS["llama-3-8b"]
    assert find_model("Mistral-7B") is MODELS["mistral-7b-v0.3"]


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="4 KV heads cannot be replicated over tensor_parallel_size 7"):
        make_plan(inputs("qwen2.5-7b", tp=7))  # 28 query heads split, 4 KV heads do not
    with pytest.raises(ValueError, match="do not split into replicas"):
        make_plan(replace(inputs("llama-3-8b", tp=2), num_gpus=3))
    with pytest.raises(ValueError, match="more than 0.9 of a L4 24GB"):
        make_plan(inputs("llama-3-70b", gpu="l4"))


def test_cli_table_json_and_errors(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "h200", "--dtype", "bfloat16"]) == 0
    table = capsys.readouterr().out
    assert "KV cache per token, per GPU                    131,072 B" in table
    assert "       1     3.157      316.8" in table
    assert main(["plan", "--model", "qwen3-32b", "--gpu", "h100", "-tp", "2", "--num-gpus", "8", "--json",
                 "--cost", "--gpu-hour-price", "3", "--requests-per-day", "500000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replicas"] == 4 and out["kv_bytes_per_token_per_gpu"] == 2 * 64 * 4 * 128 * 2
    assert out["cost"]["gpus_needed"] % 2 == 0
    assert main(["plan", "--model", "llama-9b", "--gpu", "h200"]) == 2
    assert "neither a checkpoint directory nor a known model" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "h200", "--max-model-len", "9000"]) == 2
    assert "exceeds the model's limit of 8192" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3-8b", "--gpu-memory", "80GiB"]) == 2
    assert "needs --gpu-memory and --gpu-bandwidth" in capsys.readouterr().err


def test_a_steps_work_counts_each_new_tokens_keys():
    # A decode at 9 tokens (position 8 attends 9 keys), a 4-token prefill after a 16-token
    # prefix hit (positions 16..19: 17 + 18 + 19 + 20 keys), a whole 3-token prompt (1 + 2 + 3).
    work = step_work([(8, 9), (16, 20), (0, 3)])
    assert work == StepWork(num_tokens=1 + 4 + 3, context_tokens=9 + 20 + 3, attention_keys=9 + 74 + 6)
    assert decode_work(4, 9) == step_work([(8, 9)] * 4)
    roof = StepRoofline(weight_bytes=1000, matmul_params=10, kv_bytes_per_token=2, attention_flops_per_key=4,
                        bandwidth=100.0, peak_flops=10.0)
    assert roof.cost(work) == StepCost(1000 + 2 * 32, 2 * 10 * 8 + 4 * 89, (2 * 10 * 8 + 4 * 89) / 10.0, "compute")
