"""``pagefleet plan`` for mixture-of-experts and sliding-window models: total parameters for
memory, active parameters and the experts a step reads for the decode roofline, and the KV the
engine holds under a window (no torch, no Ray)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pagefleet.cluster.cli import main
from pagefleet.cluster.plan.capacity import Lengths, PlanInputs, make_plan, mean_blocks_per_request
from pagefleet.worker.simulated.presets import GPUS, find_model
from pagefleet.worker.simulated.sizing import active_params_per_token, num_params


def inputs(model, gpu: str = "h100", tp: int = 1, **kw) -> PlanInputs:
    m = find_model(model) if isinstance(model, str) else model
    base = dict(model=m, gpu=GPUS[gpu], num_gpus=tp, tensor_parallel_size=tp, dtype="bfloat16",
                kv_cache_dtype="bfloat16", gpu_memory_utilization=0.9, kv_cache_bytes=None,
                max_model_len=8192, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
                lengths=Lengths(1024, 128))
    base.update(kw)
    return PlanInputs(**base)


def test_qwen3_30b_a3b_counts_30_5b_total_and_3_3b_active():
    m = find_model("Qwen/Qwen3-30B-A3B")
    h = 2048
    # per layer: q 2048x4096, k and v 2048x512, o 4096x2048, q/k norms of 128, two norms of 2048,
    # a router of 128 x 2048 and 128 experts of gate/up/down 3 x 2048x768
    attention = h * 4096 + 2 * h * 512 + 4096 * h + 2 * 128 + 2 * h
    expert = 3 * h * 768
    embed = 151936 * h
    total = 48 * (attention + 128 * h + 128 * expert) + 2 * embed + h
    active = 48 * (attention + 128 * h + 8 * expert) + 2 * embed + h
    assert num_params(m) == total == 30_532_122_624
    assert active_params_per_token(m) == active == 3_353_032_704
    # The model card: 30.5B total, 29.9B without embeddings, 3.3B activated (3.35B cut, not rounded).
    assert (round(total / 1e9, 1), round((total - 2 * embed) / 1e9, 1)) == (30.5, 29.9)
    assert math.floor(active / 1e8) / 10 == 3.3


def test_gpt_oss_20b_counts_20_9b_total_and_3_6b_active_without_its_embedding():
    m = find_model("openai/gpt-oss-20b")
    h = 2880
    # per layer: q 2880x4096, k and v 2880x512 with biases, o 4096x2880 with a bias, 64 sinks, two
    # norms; a router of 32 x 2880 with a bias; 32 experts of gate|up 2880x5760 and down 2880x2880
    # with biases
    attention = h * 4096 + 4096 + 2 * (h * 512 + 512) + 4096 * h + h + 64 + 2 * h
    router = 32 * h + 32
    expert = h * 5760 + 5760 + h * h + h
    embed = 201088 * h
    total = 24 * (attention + router + 32 * expert) + 2 * embed + h
    active = 24 * (attention + router + 4 * expert) + 2 * embed + h
    assert num_params(m) == total == 20_914_757_184
    assert active_params_per_token(m) == active == 4_187_440_704
    # OpenAI's model card counts 20.91B total and 3.61B active: the unembedding but not the
    # embedding table, which a token only gathers a row of (the roofline does not read it either).
    assert (round(total / 1e9, 2), round((active - embed) / 1e9, 2)) == (20.91, 3.61)


def test_mixtral_8x7b_counts_46_7b_total_and_12_9b_active():
    m = find_model("mistralai/Mixtral-8x7B-v0.1")
    assert find_model("mixtral-8x7b") is m
    h = 4096
    attention = h * h + 2 * h * 1024 + h * h + 2 * h
    expert = 3 * h * 14336
    embed = 32000 * h
    total = 32 * (attention + 8 * h + 8 * expert) + 2 * embed + h
    active = 32 * (attention + 8 * h + 2 * expert) + 2 * embed + h
    assert num_params(m) == total == 46_702_792_704
    assert active_params_per_token(m) == active == 12_879_925_248
    assert (round(total / 1e9, 1), round(active / 1e9, 1)) == (46.7, 12.9)  # Mistral's announcement


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b"])
def test_memory_holds_every_expert_and_a_decode_step_reads_those_it_routes_to(name):
    m = find_model(name)
    plan = make_plan(inputs(name, tp=2, num_gpus=2))
    expert = m.num_moe_layers * (3 * m.hidden_size * m.moe_intermediate_size // 2
                                 + (m.moe_intermediate_size + m.hidden_size if m.expert_bias else 0))
    assert plan.expert_bytes_per_gpu == 2 * expert
    embed = 2 * (m.vocab_size // 2) * m.hidden_size
    assert plan.weight_bytes_per_gpu == plan.decode_weight_bytes_per_gpu + m.num_experts * 2 * expert + embed
    kv_read = (1024 + 64) * plan.kv_bytes_per_token_per_gpu
    for step in plan.decode:
        experts = min(m.num_experts, step.batch * m.num_experts_per_tok)
        assert step.experts_read == experts
        assert step.bytes_read == plan.decode_weight_bytes_per_gpu + experts * 2 * expert + step.batch * kv_read
    # On one GPU, batch 1 reads the active parameters' weights but the embedding table (gpt-oss's
    # sinks in float32: 2 more bytes each).
    one = make_plan(inputs(name, gpu="h200"))  # Mixtral needs its 141 GB
    kv_read = (1024 + 64) * one.kv_bytes_per_token_per_gpu
    sinks = m.num_layers * m.num_heads * 2 if m.attention_sinks else 0
    assert one.decode[0].bytes_read - kv_read == 2 * (active_params_per_token(m) - m.vocab_size * m.hidden_size) + sinks


def test_moe_decode_reads_what_a_dense_model_of_its_active_size_reads_at_batch_1_and_more_after():
    moe = find_model("qwen3-30b-a3b")
    # Qwen3-30B-A3B's 8 experts of 768 as one dense MLP of 6144, without the router.
    dense = replace(moe, name="dense-A3B", intermediate_size=8 * 768, num_experts=0, num_experts_per_tok=0,
                    moe_intermediate_size=0, num_moe_layers=0)
    router = 48 * 128 * 2048
    assert active_params_per_token(moe) - num_params(dense) == router
    lengths = Lengths(1024, 128)
    moe_plan, dense_plan = (make_plan(inputs(m, lengths=lengths)) for m in (moe, dense))
    by_batch = {s.batch: s for s in dense_plan.decode}
    for step in moe_plan.decode:
        d = by_batch[step.batch]
        extra_experts = min(128, 8 * step.batch) - 8  # experts beyond a token's 8, each 3 x 2048 x 768
        assert step.bytes_read - d.bytes_read == 2 * router + 2 * 48 * extra_experts * 3 * 2048 * 768
    # At batch 1 the two differ by the time of reading the router alone.
    bandwidth = GPUS["h100"].bandwidth
    assert moe_plan.decode[0].ms - dense_plan.decode[0].ms == pytest.approx(2 * router / bandwidth * 1e3, rel=1e-9)
    # At batch 16 every expert is read: 16x the MLP weights, so the step is slower than dense's.
    assert by_batch[16].bound == "memory" and moe_plan.decode[4].batch == 16
    assert moe_plan.decode[4].ms / by_batch[16].ms > 5


def test_a_window_in_every_layer_caps_the_kv_a_sequence_holds():
    # Mistral-7B-v0.1: v0.3's shape with its 4096-token window in every layer.
    windowed = replace(find_model("mistral-7b-v0.3"), name="Mistral-7B-v0.1", sliding_windows=(4096,) * 32)
    lengths = Lengths(16384, 256)
    full = make_plan(inputs("mistral-7b-v0.3", max_model_len=32768, lengths=lengths))
    plan = make_plan(inputs(windowed, max_model_len=32768, lengths=lengths))
    assert (full.kv_sliding_window, full.max_tokens_held_per_seq) == (None, 32768)
    # the window, one 2048-token step, and the block the window starts inside
    assert (plan.kv_sliding_window, plan.max_tokens_held_per_seq) == (4096, 4095 + 2048 + 16)
    # 16384 + 256 tokens: 1040 blocks, of which the first (16640 - 4096) // 16 = 784 are given back
    assert mean_blocks_per_request(lengths, 16, 4096) == 1040 - 784 == 256
    assert full.mean_blocks_per_request == 1040
    assert plan.num_blocks == full.num_blocks
    assert (plan.concurrent_requests_paged, full.concurrent_requests_paged) == (
        plan.num_blocks // 256, full.num_blocks // 1040)


def test_windowed_mean_blocks_equal_brute_force_over_the_length_ranges():
    lengths = Lengths(40, 12, 0.5)
    plo, phi = lengths.bounds(40)
    olo, ohi = lengths.bounds(12)
    held = [-(-(p + o) // 8) - max(0, p + o - 20) // 8 for p in range(plo, phi + 1) for o in range(olo, ohi + 1)]
    assert mean_blocks_per_request(lengths, 8, 20) == pytest.approx(sum(held) / len(held), rel=1e-12)


def test_gpt_oss_mixes_full_and_sliding_layers_so_the_engine_keeps_all_its_kv():
    plan = make_plan(inputs("gpt-oss-20b"))
    assert (plan.kv_sliding_window, plan.max_tokens_held_per_seq) == (None, 8192)
    assert plan.kv_bytes_per_token_per_gpu == 2 * 24 * 8 * 64 * 2
    assert plan.mean_blocks_per_request == 72  # (1024 + 128) / 16: every token's KV


@pytest.mark.parametrize("model,lines", [
    ("qwen3-30b-a3b", ["  parameters                                     30.53 B (30,532,122,624)",
                       "  active parameters per token                    3.35 B (8 of 128 experts in 48 layers)"]),
    ("gpt-oss-20b", ["  parameters                                     20.91 B (20,914,757,184)",
                     "  active parameters per token                    4.19 B (4 of 32 experts in 24 layers)",
                     "  sliding window                                 128 tokens in 12 of 24 layers; the engine "
                     "keeps every layer's KV for a model that mixes full and sliding layers, so a sequence "
                     "holds all its tokens"]),
    ("mixtral-8x7b", ["  parameters                                     46.70 B (46,702,792,704)",
                      "  active parameters per token                    12.88 B (2 of 8 experts in 32 layers)"]),
])
def test_the_plan_prints_total_and_active_parameters(capsys, model, lines):
    assert main(["plan", "--model", model, "--gpu", "h100", "--tensor-parallel-size", "2",
                 "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out.splitlines()
    for line in lines:
        assert line in out
    m = find_model(model)
    header = next(i for i, line in enumerate(out) if line.strip().startswith("batch"))
    assert out[header].split() == ["batch", "experts", "ms/step", "tok/s/seq", "tok/s/replica", "tok/s", "all",
                                   "bound"]
    assert [int(row.split()[1]) for row in out[header + 1:header + 4]] == [
        m.num_experts_per_tok, 2 * m.num_experts_per_tok, min(m.num_experts, 4 * m.num_experts_per_tok)]
