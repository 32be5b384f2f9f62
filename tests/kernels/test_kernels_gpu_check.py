"""`benchmarks/gpu_check.sh --dry-run`: the GPU check's code runs on CPU and prints the lines it promises."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache",
           "paged_attention", "paged_attention_decode", "paged_attention_split_kv", "write_kv_cache_fp8",
           "paged_attention_fp8", "paged_attention_split_kv_fp8", "fp8_weight_matmul"}
BANDWIDTH = {"torch_copy (practical ceiling)", "paged_attention_decode", "paged_attention_decode_small_batch",
             "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache"}


def test_gpu_check_dry_run_prints_every_result():
    env = {k: v for k, v in os.environ.items() if k != "PAGEFLEET_KERNELS"}
    env["PYTHON"] = sys.executable
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert all(line["dry_run"] is True and line["device"] == "cpu (dry run)" for line in lines)
    by_check: dict[str, list[dict]] = {}
    for line in lines:
        by_check.setdefault(line["check"], []).append(line)
    assert "error" not in by_check and "skipped" not in by_check, by_check.get("error") or by_check.get("skipped")
    assert [s["section"] for s in by_check["section_done"]] == ["correctness", "bandwidth", "engine", "moe"]

    correctness = by_check["correctness"]
    assert {(c["kernel"], c["dtype"]) for c in correctness} == {(k, d) for k in KERNELS
                                                               for d in ("bfloat16", "float16")}
    assert all(c["ok"] is True and c["max_abs_error"] is not None for c in correctness), correctness

    bandwidth = by_check["bandwidth"]
    assert {b["kernel"] for b in bandwidth} == BANDWIDTH
    assert all(b["bytes"] > 0 and b["time_us"] > 0 and "fraction_of_peak" in b for b in bandwidth)

    variants = ["bf16, CUDA graphs", "bf16, CUDA graphs, no async scheduling", "bf16, greedy windows of 8",
                "fp8 weights", "fp8 KV cache", "bf16, eager"]
    assert [s["variant"] for s in by_check["engine_setup"]] == variants
    # Async output processing as on CUDA; async scheduling by default, except where asked off or
    # where greedy windows take its place.
    assert [(s["async_output"], s["async_scheduling"]) for s in by_check["engine_setup"]] == [
        (True, True), (True, False), (True, False), (True, True), (True, True), (True, True)]
    for setup in by_check["engine_setup"]:
        assert setup["weight_bytes"] > setup["decode_step_weight_bytes"] > 0
        assert (setup["kv_pool_blocks"], setup["kv_pool_sized_by"]) == (20, "kv_cache_bytes")  # 320 tokens
    assert [t["variant"] for t in by_check["engine_throughput"]] == variants
    for throughput in by_check["engine_throughput"]:
        assert throughput["output_tokens"] == throughput["num_requests"] * throughput["output_len"] == 16
        assert {"output_tokens_per_s", "roofline_tokens_per_s", "fraction_of_roofline"} <= throughput.keys()
    assert [s["variant"] for s in by_check["engine_single_stream"]] == variants
    assert all(s["per_token_latency_ms"] > 0 for s in by_check["engine_single_stream"])
    assert [t["variant"] for t in by_check["engine_ttft"]] == variants
    # Every other engine against the first on the same weights: bf16 eager gives the same logits.
    logits = {line["variant"]: line for line in by_check["engine_logits_vs_bf16"]}
    assert list(logits) == variants[1:]
    for same in ("bf16, eager", "bf16, greedy windows of 8", "bf16, CUDA graphs, no async scheduling"):
        assert logits[same]["cosine_min"] == 1.0 and logits[same]["greedy_agreement"] == 1.0
    assert all(line["positions"] == 32 for line in logits.values())
    # On CPU the graph path runs uncaptured, and equals the eager forward exactly.
    graph_lines = by_check["engine_graph_vs_eager"]
    assert [(g["kind"], g["rows"], g["prompt"], g["bucket"], g["captured"], g["outputs_equal"])
            for g in graph_lines] == [("decode", 1, 0, 1, False, True), ("decode", 3, 0, 4, False, True),
                                      ("prefill and mixed", 0, 12, 16, False, True),
                                      ("prefill and mixed", 2, 9, 16, False, True)]
    _moe_lines(by_check)
    profiles = by_check["engine_step_profile"]
    assert [p["variant"] for p in profiles] == ["bf16, CUDA graphs", "fp8 weights"]
    for profile in profiles:  # on CPU no device kernel is seen: the whole step is host time
        assert (profile["steps"], profile["device_kernel_ms_per_step"], profile["kernel_events_per_step"]) == (4, 0, 0)
        assert profile["wall_ms_per_step"] > 0 and profile["top_kernels"] == []


def _moe_lines(by_check: dict[str, list[dict]]) -> None:
    """The MoE section: a tiny Qwen3-MoE (8 experts, top 2, 2 layers) planned as the engine holds it."""
    (setup,) = by_check["moe_setup"]
    assert (setup["num_experts"], setup["experts_per_token"], setup["moe_layers"]) == (8, 2, 2)
    assert setup["cuda_graphs"] is False  # the engine runs MoE models eagerly
    assert setup["weight_bytes"] == setup["planned_weight_bytes"] == 2 * setup["num_params"]
    # 2 layers x 3 x 128 x 64 weights of one expert, bf16; 6 of the 8 experts a token skips
    assert setup["expert_bytes"] == 2 * 2 * 3 * 128 * 64 == 98304
    assert setup["num_params"] - setup["active_params"] == 6 * 98304 // 2
    (single,) = by_check["moe_single_stream"]
    assert single["experts_read_per_layer"] == 2 and single["per_token_latency_ms"] > 0
    throughput = by_check["moe_throughput"]
    assert [(t["num_requests"], t["experts_read_per_layer"], t["output_tokens"]) for t in throughput] == [
        (2, 4, 8), (4, 8, 16)]
    # from 2 to 4 sequences: 4 more experts' weights and 2 more sequences' KV (8 + 4 / 2 tokens of
    # 2 layers x 2 KV heads x 32 dims, K and V, bf16)
    kv = 10 * 2 * 2 * 2 * 32 * 2
    assert throughput[1]["bytes_per_step"] - throughput[0]["bytes_per_step"] == 4 * 98304 + 2 * kv
