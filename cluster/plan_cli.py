"""``pagefleet plan``: the KV cache capacity and cost planner on the command line (flags,
model and GPU lookup, the table and ``--json``). The arithmetic is ``cluster/plan.py``."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

from pagefleet.cluster.config import parse_bytes
from pagefleet.cluster.plan import CostInputs, Lengths, Plan, PlanInputs, make_plan
from pagefleet.cluster.plan_presets import GPUS, MODELS, GPUSpec, ModelShape, find_gpu, find_model
from pagefleet.worker.engine_args import EngineArgs

_DEFAULTS = EngineArgs()


def register(sub) -> None:
    p = sub.add_parser("plan", help="KV cache capacity, decode roofline and cost for a model on GPUs",
                       description="Size the KV cache pool as the engine does at start-up, and turn it into "
                                   "concurrency, a decode roofline and (with --cost) GPUs and money.")
    p.set_defaults(command="plan", run=run)
    p.add_argument("--model", required=True,
                   help=f"checkpoint directory, or a known model: {', '.join(m.name for m in MODELS.values())}")
    p.add_argument("--gpu", help=f"GPU preset: {', '.join(GPUS)} (without --gpu or --gpu-memory: a CPU engine)")
    p.add_argument("--gpu-memory", type=_bytes, help="GPU memory instead of a preset, e.g. 80GiB")
    p.add_argument("--gpu-bandwidth", type=_rate, help="peak memory bandwidth, e.g. 3.35TB/s")
    p.add_argument("--gpu-tflops", type=float, help="peak 16-bit dense tensor TFLOP/s")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs in all (default: one replica's)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=_DEFAULTS.tensor_parallel_size)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "fp8"],
                   help="default: the model dtype (what pagefleet stores); fp8 only to compare with engines that have it")
    p.add_argument("--gpu-memory-utilization", type=float, default=_DEFAULTS.gpu_memory_utilization)
    p.add_argument("--kv-cache-bytes", type=_bytes, default=None,
                   help="the KV budget per GPU (rank), as `serve --kv-cache-bytes`; CPU default 512MiB")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's limit")
    p.add_argument("--block-size", type=int, default=_DEFAULTS.block_size, choices=[8, 16, 32, 64, 128])
    p.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens)
    p.add_argument("--input-len", type=int, default=1024, help="mean prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="mean output tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform on [L(1-r), L(1+r)], as `bench --random-range-ratio`")
    cost = p.add_argument_group("cost (with --cost)")
    cost.add_argument("--cost", action="store_true", help="add GPUs needed, cost per million tokens, monthly cost")
    cost.add_argument("--gpu-hour-price", type=float, help="price of one GPU-hour")
    cost.add_argument("--requests-per-day", type=float)
    cost.add_argument("--mean-prompt-tokens", type=int, help="default: --input-len")
    cost.add_argument("--mean-output-tokens", type=int, help="visible output tokens; default: --output-len")
    cost.add_argument("--reasoning-multiplier", type=float, default=1.0,
                      help="tokens generated per visible output token (hidden reasoning), e.g. 4")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(inputs_from_args(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagefleet plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan)) if args.json else render(plan))
    return 0


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    model, config_dtype, limit = _model(args.model, args.max_model_len)
    dtype = config_dtype if args.dtype == "auto" else args.dtype
    tp = args.tensor_parallel_size
    num_gpus = tp if args.num_gpus is None else args.num_gpus
    for name in ("num_gpus", "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "input_len",
                 "output_len"):
        value = num_gpus if name == "num_gpus" else getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    return PlanInputs(model=model, gpu=_gpu(args), num_gpus=num_gpus, tensor_parallel_size=tp, dtype=dtype,
                      kv_cache_dtype=dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
                      gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=args.kv_cache_bytes,
                      max_model_len=limit, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      lengths=Lengths(args.input_len, args.output_len, args.range_ratio), cost=_cost(args))


def _model(name: str, max_model_len: int | None) -> tuple[ModelShape, str, int]:
    """(shape, its dtype, max_model_len): a preset, or a checkpoint read by the engine's own reader."""
    preset = find_model(name)
    if preset is not None and not Path(name).expanduser().is_dir():
        if max_model_len is not None and max_model_len > preset.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit of "
                             f"{preset.max_position_embeddings} tokens")
        return preset, preset.dtype, max_model_len or preset.max_position_embeddings
    if not Path(name).expanduser().is_dir():
        raise ValueError(f"{name!r} is neither a checkpoint directory nor a known model "
                         f"({', '.join(m.name for m in MODELS.values())})")
    from pagefleet.worker.config import load_model_config  # torch comes with it

    cfg = load_model_config(name, max_model_len=max_model_len)
    shape = ModelShape(cfg.served_model_name, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                       cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings,
                       cfg.tie_word_embeddings, cfg.attention_bias, cfg.mlp_bias, cfg.qk_norm,
                       str(cfg.dtype).removeprefix("torch."))
    return shape, shape.dtype, cfg.max_model_len


def _gpu(args: argparse.Namespace) -> GPUSpec | None:
    custom = (args.gpu_memory, args.gpu_bandwidth, args.gpu_tflops)
    if args.gpu is None and all(v is None for v in custom):
        return None
    base = find_gpu(args.gpu) if args.gpu else None
    if base is None and (args.gpu_memory is None or args.gpu_bandwidth is None):
        raise ValueError("a custom GPU needs --gpu-memory and --gpu-bandwidth (or give a --gpu preset)")
    return GPUSpec(base.name if base else "custom GPU",
                   args.gpu_memory or base.memory_bytes, args.gpu_bandwidth or base.bandwidth,
                   args.gpu_tflops * 1e12 if args.gpu_tflops else (base.flops if base else float("inf")))


def _cost(args: argparse.Namespace) -> CostInputs | None:
    if not args.cost:
        return None
    if args.gpu is None and args.gpu_bandwidth is None:
        raise ValueError("--cost needs a GPU (--gpu or --gpu-memory/--gpu-bandwidth)")
    if args.gpu_hour_price is None or args.requests_per_day is None:
        raise ValueError("--cost needs --gpu-hour-price and --requests-per-day")
    if args.gpu_hour_price < 0 or args.requests_per_day <= 0 or args.reasoning_multiplier < 1:
        raise ValueError("--gpu-hour-price must be >= 0, --requests-per-day > 0, --reasoning-multiplier >= 1")
    return CostInputs(args.gpu_hour_price, args.requests_per_day, args.mean_prompt_tokens or args.input_len,
                      args.mean_output_tokens or args.output_len, args.reasoning_multiplier)


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _rate(text: str) -> float:
    """``3.35TB/s``, ``864GB/s``, or bytes/s."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([TGM]B/s)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a bandwidth: {text!r} (use e.g. 3.35TB/s or 864GB/s)")
    scale = {None: 1, "tb/s": 1e12, "gb/s": 1e9, "mb/s": 1e6}[match.group(2) and match.group(2).lower()]
    return float(match.group(1)) * scale


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def render(plan: Plan) -> str:
    p, m = plan.inputs, plan.inputs.model
    rows: list[tuple[str, str] | str] = []
    where = f"{p.num_gpus} x {p.gpu.name}" if p.gpu else "CPU"
    rows.append(f"{m.name} on {where}: tensor_parallel_size {p.tensor_parallel_size}, {plan.replicas} "
                f"replica(s); {p.dtype} weights, {p.kv_cache_dtype} KV cache, max_model_len {p.max_model_len}")
    rows += ["model", ("parameters", f"{plan.num_params / 1e9:,.2f} B"),
             ("weights per GPU", f"{_gib(plan.weight_bytes_per_gpu)} ({plan.weight_bytes_per_gpu:,} B)"),
             ("KV cache per token, per GPU", f"{plan.kv_bytes_per_token_per_gpu:,} B"),
             ("KV cache per token, per replica", f"{plan.kv_bytes_per_token_per_replica:,} B")]
    rows.append("KV pool, per GPU (every GPU of a replica holds the same blocks)")
    if plan.peak_estimate_bytes is not None:
        rows += [("GPU memory x utilization", f"{_gib(p.gpu.memory_bytes)} x {p.gpu_memory_utilization:g}"),
                 ("estimated profile peak", f"{_gib(plan.peak_estimate_bytes)} (weights, activations and scratch "
                                            f"KV of a {p.max_num_batched_tokens}-token step)")]
    rows += [("budget", f"{_gib(plan.kv_budget_bytes_per_gpu)} ({plan.kv_budget_source})"),
             (f"blocks of {p.block_size} tokens", f"{plan.num_blocks:,} ({_gib(plan.kv_pool_bytes_per_gpu)})"),
             ("tokens", f"{plan.num_tokens:,}"),
             (f"max concurrency at max_model_len", f"{plan.max_concurrency_at_max_model_len:.2f}x")]
    lens = p.lengths
    rows.append(f"concurrent requests per replica ({lens.input_len} + {lens.output_len} tokens"
                + (f", range ratio {lens.range_ratio:g})" if lens.range_ratio else ")"))
    rows += [("KV blocks per request (mean, at full length)", f"{plan.mean_blocks_per_request:.2f}"),
             ("paged blocks", f"{plan.concurrent_requests_paged:,}"),
             ("contiguous max_model_len reservations", f"{plan.concurrent_requests_contiguous:,}"),
             ("paged / contiguous", f"{plan.paged_over_contiguous:.1f}x"),
             ("engine cap (max_num_seqs)", f"{p.max_num_seqs}")]
    out = _format_rows(rows)
    if plan.decode:
        out += _render_decode(plan)
    if plan.cost is not None:
        out += _render_cost(plan)
    return out


def _format_rows(rows) -> str:
    lines = []
    for row in rows:
        lines.append(row if isinstance(row, str) else f"  {row[0]:<46} {row[1]}")
    return "\n".join(lines) + "\n"


def _render_decode(plan: Plan) -> str:
    p = plan.inputs
    lines = [f"decode roofline ({p.gpu.bandwidth / 1e12:g} TB/s, {p.gpu.flops / 1e12:g} TFLOP/s per GPU; mean "
             f"context {p.lengths.mean_context:g} tokens; reads {_gib(plan.decode_weight_bytes_per_gpu)} of "
             "weights per step: all but the embedding table; all-reduce time not modelled)",
             f"  {'batch':>6} {'ms/step':>9} {'tok/s/seq':>10} {'tok/s/replica':>14} {'tok/s all':>11}  bound"]
    for s in plan.decode:
        lines.append(f"  {s.batch:>6} {s.ms:>9.3f} {s.tokens_per_s_per_seq:>10.1f} {s.tokens_per_s_per_replica:>14.1f}"
                     f" {s.tokens_per_s_total:>11.1f}  {s.bound}")
    lines.append(f"  compute-bound from batch {plan.compute_bound_from_batch}" if plan.compute_bound_from_batch
                 else "  memory-bound up to the largest batch the pool and max_num_seqs allow")
    return "\n".join(lines) + "\n"


def _render_cost(plan: Plan) -> str:
    c, ci = plan.cost, plan.inputs.cost
    gen = f" x {ci.reasoning_multiplier:g} generated" if ci.reasoning_multiplier != 1 else ""
    rows = [f"cost ({ci.requests_per_day:,.0f} requests/day of {ci.mean_prompt_tokens} prompt + "
            f"{ci.mean_output_tokens}{gen} output tokens; at the roofline: a lower bound)",
            ("operating batch per replica", f"{c.operating_batch}"),
            ("GPU seconds per request (prefill + decode)", f"{c.prefill_s_per_request:.4f} + {c.decode_s_per_request:.4f}"),
            ("requests/s per replica", f"{c.requests_per_s_per_replica:,.2f}"),
            ("GPUs needed", f"{c.gpus_needed} ({c.replicas_needed} replica(s))"),
            ("monthly cost", f"{c.monthly_cost:,.0f} ({c.gpus_needed} GPUs x {ci.gpu_hour_price:g}/h x 730 h)"),
            ("per million tokens (prompt + output)", f"{c.cost_per_million_tokens:,.4f}"),
            ("per million output tokens", f"{c.cost_per_million_output_tokens:,.4f}"),
            ("per million tokens at full load", f"{c.cost_per_million_tokens_at_full_load:,.4f}")]
    return _format_rows(rows)
