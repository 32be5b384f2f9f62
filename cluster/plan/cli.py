"""``pagefleet plan``: the KV cache capacity and cost planner on the command line (flags,
model and GPU lookup, the table and ``--json``). The arithmetic is ``cluster/plan/capacity.py``."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pagefleet.cluster.plan.capacity import CostInputs, Lengths, Plan, PlanInputs, make_plan
from pagefleet.worker.engine_args import DEFAULT_GPU_MEMORY_UTILIZATION, EngineArgs
from pagefleet.worker.options import add_cli_args, check_choices, from_namespace, option, parse_bytes
from pagefleet.worker.simulated.presets import GPUS, MODELS, GPUSpec, ModelShape, find_gpu, find_model
from pagefleet.worker.simulated.sizing import model_shape_of

# The engine's own options: the same flags, defaults and checks as `pagefleet serve`.
ENGINE_OPTIONS = ("dtype", "tensor_parallel_size", "gpu_memory_utilization", "kv_cache_bytes", "max_model_len",
                  "block_size", "max_num_seqs", "max_num_batched_tokens")


def parse_rate(text: str) -> float:
    """``3.35TB/s``, ``864GB/s``, or bytes/s."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([TGM]B/s)?\s*", str(text), flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a bandwidth: {text!r} (use e.g. 3.35TB/s or 864GB/s)")
    scale = {None: 1, "tb/s": 1e12, "gb/s": 1e9, "mb/s": 1e6}[match.group(2) and match.group(2).lower()]
    return float(match.group(1)) * scale


@dataclass(slots=True)
class PlanArgs:
    """The options of `pagefleet plan` beside the engine's."""

    model: str | None = option(None, help="checkpoint directory, or a known model: "
                                          + ", ".join(m.name for m in MODELS.values()))
    gpu: str | None = option(None, help=f"GPU preset: {', '.join(GPUS)} (without --gpu or --gpu-memory: a CPU "
                                        "engine, whose budget is --kv-cache-bytes)")
    gpu_memory: int | None = option(None, parse=parse_bytes, metavar="BYTES", help="GPU memory, e.g. 80GiB")
    gpu_bandwidth: float | None = option(None, parse=parse_rate, metavar="RATE",
                                         help="peak memory bandwidth, e.g. 3.35TB/s")
    gpu_tflops: float | None = option(None, help="peak 16-bit dense tensor TFLOP/s")
    num_gpus: int | None = option(None, help="GPUs in all (default: one replica's)")
    kv_cache_dtype: str = option("auto", choices=("auto", "bfloat16", "float16", "float32", "fp8"),
                                 help="auto: the model dtype, what pagefleet stores by default; fp8: an e4m3 "
                                      "cache, 1 byte an element (`pagefleet serve --kv-cache-dtype fp8`)")
    input_len: int = option(1024, help="mean prompt tokens per request")
    output_len: int = option(128, help="mean output tokens per request")
    range_ratio: float = option(0.0, help="lengths uniform on [L(1-r), L(1+r)], as `bench --random-range-ratio`")
    cost: bool = option(False, help="add GPUs needed, cost per million tokens and a monthly cost")
    gpu_hour_price: float | None = option(None, help="price of one GPU-hour (--cost)")
    requests_per_day: float | None = option(None, help="requests per day (--cost)")
    mean_prompt_tokens: int | None = option(None, help="--cost's prompt tokens per request (default: --input-len)")
    mean_output_tokens: int | None = option(None, help="--cost's visible output tokens (default: --output-len)")
    reasoning_multiplier: float = option(1.0, help="tokens generated per visible output token (hidden "
                                                   "reasoning), e.g. 4")
    json: bool = option(False, help="print the plan as one JSON object")

    def __post_init__(self) -> None:
        check_choices(self)
        if not self.model:
            raise ValueError("--model is required: a checkpoint directory or a known model")
        if self.gpu is not None:
            find_gpu(self.gpu)  # raises for an unknown name
        for name in ("num_gpus", "input_len", "output_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.gpu is None and any(v is not None for v in (self.gpu_memory, self.gpu_bandwidth, self.gpu_tflops)) \
                and (self.gpu_memory is None or self.gpu_bandwidth is None):
            raise ValueError("a custom GPU needs --gpu-memory and --gpu-bandwidth (or give a --gpu preset)")
        if self.cost:
            if self.gpu is None and self.gpu_bandwidth is None:
                raise ValueError("--cost needs a GPU (--gpu or --gpu-memory/--gpu-bandwidth)")
            if self.gpu_hour_price is None or self.requests_per_day is None:
                raise ValueError("--cost needs --gpu-hour-price and --requests-per-day")
            if self.gpu_hour_price < 0 or self.requests_per_day <= 0 or self.reasoning_multiplier < 1:
                raise ValueError("--gpu-hour-price must be >= 0, --requests-per-day > 0, --reasoning-multiplier >= 1")


def register(sub) -> None:
    p = sub.add_parser("plan", help="KV cache capacity, decode roofline and cost for a model on GPUs",
                       description="Size the KV cache pool as the engine does at start-up, and turn it into "
                                   "concurrency, a decode roofline and (with --cost) GPUs and money.")
    p.set_defaults(command="plan", run=run)
    add_cli_args(p, PlanArgs)
    add_cli_args(p.add_argument_group("engine options (as `pagefleet serve`)"), EngineArgs, only=ENGINE_OPTIONS)


def run(args: argparse.Namespace) -> int:
    try:
        plan_args = from_namespace(PlanArgs, args)
        engine = EngineArgs(**{name: getattr(args, name) for name in ENGINE_OPTIONS})
        plan = make_plan(plan_inputs(plan_args, engine))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagefleet plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan)) if plan_args.json else render(plan))
    return 0


def plan_inputs(a: PlanArgs, engine: EngineArgs) -> PlanInputs:
    model, config_dtype, limit = _model(a.model, engine.max_model_len)
    dtype = config_dtype if engine.dtype == "auto" else engine.dtype
    tp = engine.tensor_parallel_size
    utilization = engine.gpu_memory_utilization
    return PlanInputs(model=model, gpu=_gpu(a), num_gpus=a.num_gpus or tp, tensor_parallel_size=tp, dtype=dtype,
                      kv_cache_dtype=dtype if a.kv_cache_dtype == "auto" else a.kv_cache_dtype,
                      gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization,
                      kv_cache_bytes=engine.kv_cache_bytes, max_model_len=limit, block_size=engine.block_size,
                      max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                      lengths=Lengths(a.input_len, a.output_len, a.range_ratio), cost=_cost(a))


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
    from pagefleet.worker.model_executor.model_config import load_model_config  # torch comes with it

    cfg = load_model_config(name, max_model_len=max_model_len)
    shape = model_shape_of(cfg)
    return shape, shape.dtype, cfg.max_model_len


def _gpu(a: PlanArgs) -> GPUSpec | None:
    if a.gpu is None and a.gpu_memory is None:
        return None
    base = find_gpu(a.gpu) if a.gpu else None
    return GPUSpec(base.name if base else "custom GPU", a.gpu_memory or base.memory_bytes,
                   a.gpu_bandwidth or base.bandwidth,
                   a.gpu_tflops * 1e12 if a.gpu_tflops else (base.flops if base else float("inf")))


def _cost(a: PlanArgs) -> CostInputs | None:
    if not a.cost:
        return None
    return CostInputs(a.gpu_hour_price, a.requests_per_day, a.mean_prompt_tokens or a.input_len,
                      a.mean_output_tokens or a.output_len, a.reasoning_multiplier)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def render(plan: Plan) -> str:
    p, m = plan.inputs, plan.inputs.model
    rows: list[tuple[str, str] | str] = []
    where = f"{p.num_gpus} x {p.gpu.name}" if p.gpu else "CPU"
    rows.append(f"{m.name} on {where}: tensor_parallel_size {p.tensor_parallel_size}, {plan.replicas} "
                f"replica(s); {p.dtype} weights, {p.kv_cache_dtype} KV cache, max_model_len {p.max_model_len}")
    rows += ["model", ("parameters", f"{plan.num_params / 1e9:,.2f} B ({plan.num_params:,})")]
    if m.num_experts:
        rows += [("active parameters per token", f"{plan.num_active_params / 1e9:,.2f} B ({m.num_experts_per_tok} of "
                                                 f"{m.num_experts} experts in {m.num_moe_layers} layers)")]
    rows += [("weights per GPU", f"{_gib(plan.weight_bytes_per_gpu)} ({plan.weight_bytes_per_gpu:,} B)"),
             ("KV cache per token, per GPU", f"{plan.kv_bytes_per_token_per_gpu:,} B"),
             ("KV cache per token, per replica", f"{plan.kv_bytes_per_token_per_replica:,} B")]
    if m.sliding_windows:
        rows += [("sliding window", _window_text(plan))]
    rows.append("KV pool, per GPU (every GPU of a replica holds the same blocks)")
    if plan.peak_estimate_bytes is not None:
        rows += [("GPU memory x utilization", f"{_gib(p.gpu.memory_bytes)} x {p.gpu_memory_utilization:g}"),
                 ("estimated profile peak", f"{_gib(plan.peak_estimate_bytes)} (weights, activations and scratch "
                                            f"KV of a {p.max_num_batched_tokens}-token step)")]
    rows += [("budget", f"{_gib(plan.kv_budget_bytes_per_gpu)} ({plan.kv_budget_source})"),
             (f"blocks of {p.block_size} tokens", f"{plan.num_blocks:,} ({_gib(plan.kv_pool_bytes_per_gpu)})"),
             ("tokens", f"{plan.num_tokens:,}"),
             ("max concurrency at max_model_len", f"{plan.max_concurrency_at_max_model_len:.2f}x")]
    lens = p.lengths
    rows.append(f"concurrent requests per replica ({lens.input_len} + {lens.output_len} tokens"
                + (f", range ratio {lens.range_ratio:g})" if lens.range_ratio else ")"))
    rows += [("KV blocks per request (mean, at full length)", f"{plan.mean_blocks_per_request:.2f}"),
             ("paged blocks", f"{plan.concurrent_requests_paged:,}"),
             ("contiguous max_model_len reservations", f"{plan.concurrent_requests_contiguous:,}"),
             ("paged / contiguous", f"{plan.paged_over_contiguous:.1f}x" if plan.paged_over_contiguous is not None
              else "- (the pool holds less than one max_model_len; the window bounds what a sequence holds)"),
             ("engine cap (max_num_seqs)", f"{p.max_num_seqs}")]
    out = _format_rows(rows)
    if plan.decode:
        out += _render_decode(plan)
    if plan.cost is not None:
        out += _render_cost(plan)
    return out


def _window_text(plan: Plan) -> str:
    """What the engine holds of a windowed model's KV."""
    m = plan.inputs.model
    sliding = [w for w in m.sliding_windows if w is not None]
    if plan.kv_sliding_window is not None:
        return (f"{plan.kv_sliding_window} tokens in every layer: a sequence holds at most "
                f"{plan.max_tokens_held_per_seq:,} tokens of KV (the window, one step and a block)")
    return (f"{max(sliding)} tokens in {len(sliding)} of {m.num_layers} layers; the engine keeps every "
            "layer's KV for a model that mixes full and sliding layers, so a sequence holds all its tokens")


def _format_rows(rows) -> str:
    lines = []
    for row in rows:
        lines.append(row if isinstance(row, str) else f"  {row[0]:<46} {row[1]}")
    return "\n".join(lines) + "\n"


def _render_decode(plan: Plan) -> str:
    p, m = plan.inputs, plan.inputs.model
    embed = plan.weight_bytes_per_gpu - plan.decode_weight_bytes_per_gpu - m.num_experts * plan.expert_bytes_per_gpu
    lines = [f"decode roofline ({p.gpu.bandwidth / 1e12:g} TB/s, {p.gpu.flops / 1e12:g} TFLOP/s per GPU; mean "
             f"context {p.lengths.mean_context:g} tokens; all-reduce time not modelled)"]
    if m.num_experts:
        lines += [f"  a step reads {_gib(plan.decode_weight_bytes_per_gpu)} of weights per GPU besides the experts "
                  f"and the {_gib(embed)} embedding table, and {_gib(plan.expert_bytes_per_gpu)} for each expert "
                  f"it routes to (its weights in all {m.num_moe_layers} MoE layers): min({m.num_experts}, batch x "
                  f"{m.num_experts_per_tok}) experts a layer"]
    else:
        lines += [f"  a step reads {_gib(plan.decode_weight_bytes_per_gpu)} of weights per GPU: all but the "
                  f"{_gib(embed)} embedding table, of which it gathers one row per sequence"]
    experts = f" {'experts':>8}" if m.num_experts else ""
    lines.append(f"  {'batch':>6}{experts} {'ms/step':>9} {'tok/s/seq':>10} {'tok/s/replica':>14} {'tok/s all':>11}  bound")
    for s in plan.decode:
        read = f" {s.experts_read:>8}" if m.num_experts else ""
        lines.append(f"  {s.batch:>6}{read} {s.ms:>9.3f} {s.tokens_per_s_per_seq:>10.1f} "
                     f"{s.tokens_per_s_per_replica:>14.1f} {s.tokens_per_s_total:>11.1f}  {s.bound}")
    lines.append(f"  compute-bound from batch {plan.compute_bound_from_batch}" if plan.compute_bound_from_batch
                 else "  memory-bound up to the largest batch the pool and max_num_seqs allow")
    return "\n".join(lines) + "\n"


def _render_cost(plan: Plan) -> str:
    c, ci = plan.cost, plan.inputs.cost
    gen = f" x {ci.reasoning_multiplier:g} generated" if ci.reasoning_multiplier != 1 else ""
    rows = [f"cost ({ci.requests_per_day:,.0f} requests/day of {ci.mean_prompt_tokens} prompt + "
            f"{ci.mean_output_tokens}{gen} output tokens; at the roofline: a lower bound)",
            ("operating batch per replica", f"{c.operating_batch}"),
            ("replica seconds per request (prefill + decode)", f"{c.prefill_s_per_request:.4f} + {c.decode_s_per_request:.4f}"),
            ("requests/s per replica", f"{c.requests_per_s_per_replica:,.2f}"),
            ("GPUs needed", f"{c.gpus_needed} ({c.replicas_needed} replica(s))"),
            ("monthly cost", f"{c.monthly_cost:,.0f} ({c.gpus_needed} GPUs x {ci.gpu_hour_price:g}/h x 730 h)"),
            ("per million tokens (prompt + output)", f"{c.cost_per_million_tokens:,.4f}"),
            ("per million output tokens", f"{c.cost_per_million_output_tokens:,.4f}"),
            ("per million tokens at full load", f"{c.cost_per_million_tokens_at_full_load:,.4f}")]
    return _format_rows(rows)
