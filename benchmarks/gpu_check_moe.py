"""The GPU check's MoE section: one engine serving a random-weight Qwen3-30B-A3B-shaped model
(Qwen3MoeForCausalLM: 128 experts of 768, top 8, hidden 2048, 32 query and 4 KV heads of 128,
per-head q/k norms, its 151936-token vocabulary) cut to 12 of its 48 layers, so that the
weights (about 16 GB) initialize and the engine starts inside the check's time budget. Each
layer is the published one, so a step's time per layer is what the full model's would be.

It measures single-stream decode and offline throughput at batches 8 and 64 against the
roofline ``pagefleet plan`` and the simulated engine use (``worker/simulated/sizing.py``): a
decode step reads the weights but the experts and the embedding table, plus min(128, batch x 8)
experts' weights in each layer and every sequence's KV. At batch 1 that is the active
parameters; from batch 16 on, every expert. The engine takes its default options, under which a
MoE model runs eagerly on CUDA (``ModelRunner.graphs_wanted``: the experts' PyTorch twin reads
each layer's expert counts on the host), so these figures include the launch overhead.
Run through gpu_check.py, which passes its ``Run`` (device, peak bandwidth, time budget, emit)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from gpu_check_engine import _single_stream, write_checkpoint_config  # beside this file

MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", rope_scaling=None, rope_theta=1e6,
           rms_norm_eps=1e-6)
QWEN3_30B_A3B_12_LAYERS = dict(MOE, hidden_size=2048, num_hidden_layers=12, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                               moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                               vocab_size=151936, max_position_embeddings=40960)
TINY_MOE = dict(MOE, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=512,
                max_position_embeddings=8192)


def check_moe(run) -> None:  # run: gpu_check.Run
    tiny = run.dry_run
    shape = TINY_MOE if tiny else QWEN3_30B_A3B_12_LAYERS
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint_config(Path(tmp), shape)
        _check(run, tmp, shape, {})


def _check(run, tmp: str, shape: dict, options: dict) -> None:
    from pagefleet.worker import LLM, SamplingParams
    from pagefleet.worker.simulated.presets import GPUSpec
    from pagefleet.worker.simulated.roofline import decode_work
    from pagefleet.worker.simulated.sizing import (
        ReplicaShape,
        active_params_per_token,
        model_shape_of,
        num_params,
        size_gpu,
        step_roofline,
    )

    tiny = run.dry_run
    prompt_len, output_len = (8, 4) if tiny else (128, 128)
    batches = (2, 4) if tiny else (8, 64)
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2
    kwargs = dict(model=tmp, load_format="dummy", dtype="bfloat16", device=run.device.type, block_size=16,
                  enable_prefix_caching=False, max_model_len=64 if tiny else 1024,
                  max_num_batched_tokens=256 if tiny else 8192, **options)
    if tiny:  # as the engine section's dry run: the CPU twins, uncaptured
        kwargs.update(max_num_seqs=4, kv_cache_bytes=(4 * 64 + 64) * kv_per_token, enforce_eager=True)
    else:
        kwargs["kv_cache_bytes"] = (max(batches) * (prompt_len + output_len) + 4096) * kv_per_token
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    startup_s = time.monotonic() - t0
    try:
        cfg = llm.engine.model_config
        m = model_shape_of(cfg)
        runner = llm.engine.executor.runner
        replica = ReplicaShape(m, GPUSpec("this device", 0, run.peak or 1.0, float("inf")), 1, "bfloat16",
                               "bfloat16", 0.9, kwargs["kv_cache_bytes"], 16, kwargs["max_num_batched_tokens"])
        sizing = size_gpu(replica)
        roof = step_roofline(replica, sizing)
        run.emit("moe_setup", model=("tiny Qwen3-MoE" if tiny else "Qwen3-30B-A3B-shaped, 12 of 48 layers, "
                                     "random weights"), options=options, startup_s=round(startup_s, 1),
                 num_experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
                 moe_layers=len(cfg.moe_layers), num_params=num_params(m), active_params=active_params_per_token(m),
                 weight_bytes=runner.weight_bytes(), planned_weight_bytes=sizing.weight_bytes,
                 expert_bytes=sizing.expert_bytes, kernels=str(runner.model.kernels),
                 cuda_graphs=runner.decode_graphs is not None,
                 kv_pool_blocks=llm.engine.pool.num_blocks)

        gen = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(10, shape["vocab_size"], (prompt_len,), generator=gen).tolist()}
                   for _ in range(max(batches))]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))  # compiles the shapes

        latency = _single_stream(llm, SamplingParams, prompts[0]["prompt_token_ids"], output_len, "moe")
        cost = roof.cost(decode_work(1, prompt_len + output_len / 2))
        roofline_s = cost.seconds if run.peak else None
        run.emit("moe_single_stream", prompt_len=prompt_len, output_len=output_len,
                 per_token_latency_ms=round(latency * 1e3, 3), bytes_per_step=int(cost.bytes_read),
                 experts_read_per_layer=roof.experts_read(1),
                 roofline_ms=round(roofline_s * 1e3, 3) if roofline_s else None,
                 fraction_of_roofline=round(roofline_s / latency, 4) if roofline_s else None)

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for num_seqs in batches:
            if run.out_of_time():
                run.emit("skipped", what=f"moe throughput x{num_seqs}", reason="time budget")
                continue
            run.sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:num_seqs], params)
            run.sync()
            wall = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            cost = roof.cost(decode_work(num_seqs, prompt_len + output_len / 2))
            roofline = num_seqs / cost.seconds if run.peak else None
            run.emit("moe_throughput", num_requests=num_seqs, prompt_len=prompt_len, output_len=output_len,
                     output_tokens=tokens, wall_s=round(wall, 3), output_tokens_per_s=round(tokens / wall, 1),
                     experts_read_per_layer=roof.experts_read(num_seqs), bytes_per_step=int(cost.bytes_read),
                     roofline_tokens_per_s=round(roofline, 1) if roofline else None,
                     fraction_of_roofline=round(tokens / wall / roofline, 4) if roofline else None,
                     note="wall time includes the prefill of every prompt")
    finally:
        llm.shutdown()
