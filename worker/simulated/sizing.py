"""One GPU of a replica, sized as the engine sizes it at start-up: its weights, its KV budget and
its step roofline. The simulated engine (``model_executor/simulated_runner.py``) runs on these
figures and ``pagefleet plan`` builds its plan on them, so the two cannot disagree. Pure
functions over plain numbers (no torch, no I/O).

The KV pool is sized by the engine's own functions (``worker/core/kv_cache_sizing.py``); on a
GPU the engine's budget is memory x utilization minus the peak its profile run reached, and
here that peak is estimated (see ``estimate_profile_peak``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagefleet.worker.core.kv_cache_sizing import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    gpu_kv_budget,
    kv_bytes_per_block,
    kv_bytes_per_token,
    kv_heads_per_rank,
)
from pagefleet.worker.engine_args import DEFAULT_GPU_MEMORY_UTILIZATION
from pagefleet.worker.simulated.presets import GPUSpec, ModelShape, find_gpu
from pagefleet.worker.simulated.roofline import StepRoofline

if TYPE_CHECKING:
    from pagefleet.worker.engine_args import EngineArgs
    from pagefleet.worker.model_executor.model_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
PROFILE_BLOCK_SIZE = 16  # the engine's profile run builds its scratch cache in blocks of 16


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """The engine options and hardware that size one GPU of a replica."""

    model: ModelShape
    gpu: GPUSpec | None  # None: a CPU engine, whose budget is kv_cache_bytes
    tensor_parallel_size: int
    dtype: str
    kv_cache_dtype: str  # a DTYPE_BYTES key
    gpu_memory_utilization: float
    kv_cache_bytes: int | None
    block_size: int
    max_num_batched_tokens: int


@dataclass(frozen=True, slots=True)
class RankShape:
    """One tensor-parallel rank's share of the model, as the engine's layers cut it."""

    heads: int
    kv_heads: int  # replicated when the model has fewer KV heads than ranks
    intermediate: int
    vocab_rows: int  # vocab-parallel embedding / LM head rows, padded to a multiple of the ranks


@dataclass(frozen=True, slots=True)
class GPUSizing:
    """One GPU of a replica at start-up."""

    weight_bytes: int
    decode_weight_bytes: int  # every step reads all weights but the embedding table and the experts
    expert_bytes: int         # one expert of every MoE layer (a step reads those it routes to)
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_budget_bytes: int
    kv_budget_source: str  # "kv_cache_bytes", "CPU default" or "gpu_memory_utilization"
    peak_estimate_bytes: int | None  # GPU only: weights + activations + profile scratch KV


def rank_shape(m: ModelShape, tp: int) -> RankShape:
    kv = kv_heads_per_rank(m.num_heads, m.num_kv_heads, tp)
    if m.intermediate_size % tp:
        raise ValueError(f"intermediate_size {m.intermediate_size} does not split over tensor_parallel_size {tp}")
    if m.moe_intermediate_size % tp:
        raise ValueError(f"moe_intermediate_size {m.moe_intermediate_size} does not split over "
                         f"tensor_parallel_size {tp}")
    return RankShape(m.num_heads // tp, kv, m.intermediate_size // tp, -(-m.vocab_size // tp))


def num_params(m: ModelShape) -> int:
    """Parameters of the whole model (tied embeddings counted once): what memory holds."""
    return weight_elements_per_rank(m, 1)


def active_params_per_token(m: ModelShape) -> int:
    """Parameters one token's forward pass uses: all but the experts the router did not pick
    (both embedding tables counted, as Mistral and Qwen count their models' active sizes)."""
    return weight_elements_per_rank(m, 1, active=True)


def expert_elements_per_rank(m: ModelShape, tp: int) -> int:
    """One expert of one MoE layer on one rank: its gate|up and down slices (TP shards every
    expert's intermediate dimension, moe.py), and with gpt-oss's biases the gate|up bias slice
    and the whole down bias, which every rank holds."""
    i = m.moe_intermediate_size // tp
    return 3 * m.hidden_size * i + ((2 * i + m.hidden_size) if m.expert_bias else 0)


def weight_elements_per_rank(m: ModelShape, tp: int, active: bool = False) -> int:
    """One rank's weights as the engine's layers cut them; ``active``: only the
    ``num_experts_per_tok`` experts of each MoE layer that one token runs."""
    r = rank_shape(m, tp)
    h, d = m.hidden_size, m.head_dim
    qkv_out = (r.heads + 2 * r.kv_heads) * d
    attention = (h * qkv_out + r.heads * d * h + 2 * h + (qkv_out if m.attention_bias else 0)
                 + (h if m.o_proj_bias else 0) + (r.heads if m.attention_sinks else 0) + (2 * d if m.qk_norm else 0))
    dense_mlp = 3 * h * r.intermediate + (2 * r.intermediate + h if m.mlp_bias else 0)
    experts = m.num_experts_per_tok if active else m.num_experts
    router = m.num_experts * (h + (1 if m.expert_bias else 0))  # replicated on every rank
    moe_mlp = experts * expert_elements_per_rank(m, tp) + router
    embed = r.vocab_rows * h
    return (m.num_layers * attention + (m.num_layers - m.num_moe_layers) * dense_mlp + m.num_moe_layers * moe_mlp
            + embed + (0 if m.tie_word_embeddings else embed) + h)


def matmul_params_per_rank(m: ModelShape, tp: int) -> int:
    """Weights one decoded token multiplies on one rank (the LM head included, the embedding not;
    in a MoE layer the router and the token's ``num_experts_per_tok`` experts)."""
    r = rank_shape(m, tp)
    h, d = m.hidden_size, m.head_dim
    attention = h * (r.heads + 2 * r.kv_heads) * d + r.heads * d * h
    moe = m.num_experts * h + m.num_experts_per_tok * 3 * h * (m.moe_intermediate_size // tp)
    return (m.num_layers * attention + (m.num_layers - m.num_moe_layers) * 3 * h * r.intermediate
            + m.num_moe_layers * moe + r.vocab_rows * h)


def estimate_profile_peak(s: ReplicaShape, weight_bytes: int, kv_per_token: int) -> int:
    """The memory the engine's profile run peaks at on one GPU, estimated: the weights, the
    rotary table ([max_position, head_dim] fp32), the largest layer activations of one
    ``max_num_batched_tokens`` step (residual and normed hidden [T, hidden], gate|up
    [T, 2 x intermediate/TP] and its activation [T, intermediate/TP]) and the scratch KV
    cache that step writes. CUDA context and NCCL buffers are not counted, as the engine's
    own measure (``torch.cuda.max_memory_allocated``) does not count them either."""
    m, t = s.model, s.max_num_batched_tokens
    r = rank_shape(m, s.tensor_parallel_size)
    rotary = m.max_position_embeddings * m.head_dim * 4
    # A MoE layer's gate|up and activation are per (token, expert) pair: k rows a token.
    dense = 3 * r.intermediate if m.num_layers > m.num_moe_layers else 0
    moe = 3 * m.num_experts_per_tok * (m.moe_intermediate_size // s.tensor_parallel_size)
    activations = t * (2 * m.hidden_size + max(dense, moe)) * DTYPE_BYTES[s.dtype]
    scratch_kv = -(-t // PROFILE_BLOCK_SIZE) * PROFILE_BLOCK_SIZE * kv_per_token
    return weight_bytes + rotary + activations + scratch_kv


def size_gpu(s: ReplicaShape) -> GPUSizing:
    """The engine's budget rule (``ModelRunner.available_kv_bytes``), with the GPU's peak estimated."""
    m, tp = s.model, s.tensor_parallel_size
    r = rank_shape(m, tp)
    weight_bytes = weight_elements_per_rank(m, tp) * DTYPE_BYTES[s.dtype]
    if m.attention_sinks:  # the engine keeps gpt-oss's sinks in float32
        weight_bytes += m.num_layers * r.heads * (4 - DTYPE_BYTES[s.dtype])
    embed_bytes = 0 if m.tie_word_embeddings else r.vocab_rows * m.hidden_size * DTYPE_BYTES[s.dtype]
    expert_bytes = m.num_moe_layers * expert_elements_per_rank(m, tp) * DTYPE_BYTES[s.dtype]
    kv_elem = DTYPE_BYTES[s.kv_cache_dtype]
    kv_token = kv_bytes_per_token(m.num_layers, r.kv_heads, m.head_dim, kv_elem)
    per_block = kv_bytes_per_block(m.num_layers, r.kv_heads, m.head_dim, kv_elem, s.block_size)
    peak = None
    if s.kv_cache_bytes is not None:
        budget, source = s.kv_cache_bytes, "kv_cache_bytes"
    elif s.gpu is None:
        budget, source = DEFAULT_CPU_KV_CACHE_BYTES, "CPU default"
    else:
        if weight_bytes > s.gpu.memory_bytes * s.gpu_memory_utilization:
            raise ValueError(f"{m.name} needs {weight_bytes / 2**30:.1f} GiB of weights per GPU at "
                             f"tensor_parallel_size {tp}, more than {s.gpu_memory_utilization:g} of a "
                             f"{s.gpu.name}; raise tensor_parallel_size")
        peak = estimate_profile_peak(s, weight_bytes, kv_token)
        budget, source = gpu_kv_budget(s.gpu.memory_bytes, s.gpu_memory_utilization, peak), "gpu_memory_utilization"
    decode_bytes = weight_bytes - embed_bytes - m.num_experts * expert_bytes
    return GPUSizing(weight_bytes, decode_bytes, expert_bytes, kv_token, per_block, budget, source, peak)


def step_roofline(s: ReplicaShape, sizing: GPUSizing) -> StepRoofline:
    """One GPU of a replica of ``s``, as a step's time sees it (``s.gpu`` must be set)."""
    m, gpu = s.model, s.gpu
    r = rank_shape(m, s.tensor_parallel_size)
    peak_flops = gpu.flops / (2 if s.dtype == "float32" else 1)  # fp32 weights: TF32 at half rate
    return StepRoofline(sizing.decode_weight_bytes, matmul_params_per_rank(m, s.tensor_parallel_size),
                        sizing.kv_bytes_per_token, 4 * r.heads * m.head_dim * m.num_layers, gpu.bandwidth,
                        peak_flops, sizing.expert_bytes, m.num_experts, m.num_experts_per_tok)


def model_shape_of(cfg: ModelConfig) -> ModelShape:
    """What sizing needs from a checkpoint the engine has read."""
    return ModelShape(cfg.served_model_name, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                      cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings,
                      cfg.tie_word_embeddings, cfg.attention_bias, cfg.mlp_bias, cfg.qk_norm,
                      str(cfg.dtype).removeprefix("torch."), cfg.num_experts, cfg.num_experts_per_tok,
                      cfg.moe_intermediate_size, len(cfg.moe_layers), cfg.architecture == "GptOssForCausalLM",
                      cfg.o_proj_bias, cfg.attention_sinks, cfg.sliding_windows)


def simulated_replica(cfg: ModelConfig, args: EngineArgs) -> ReplicaShape:
    """One GPU of ``args.simulate`` under an engine of ``args`` serving ``cfg``. The engine's
    fp8 / fp8_e4m3 KV cache is 1 byte an element, as the real engine allocates it."""
    dtype = str(cfg.dtype).removeprefix("torch.")
    utilization = args.gpu_memory_utilization
    return ReplicaShape(model=model_shape_of(cfg), gpu=find_gpu(args.simulate),
                        tensor_parallel_size=args.tensor_parallel_size, dtype=dtype,
                        kv_cache_dtype=dtype if args.kv_cache_dtype == "auto" else "fp8",
                        gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization,
                        kv_cache_bytes=args.kv_cache_bytes, block_size=args.block_size,
                        max_num_batched_tokens=args.max_num_batched_tokens)
