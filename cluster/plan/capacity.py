"""The arithmetic of ``pagefleet plan``: the KV pool, concurrency, the decode roofline and cost.
Pure functions over plain numbers (no torch, no I/O).

One GPU's weights, KV budget and step roofline are the engine's own sizing
(``worker/simulated/sizing.py``, which the simulated engine runs on); the pool is sized by the
engine's ``worker/core/kv_cache_sizing.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pagefleet.worker.core.kv_cache_sizing import max_tokens_held, size_kv_pool
from pagefleet.worker.model_executor.sliding_window import kv_sliding_window
from pagefleet.worker.simulated.presets import GPUSpec, ModelShape
from pagefleet.worker.simulated.roofline import StepRoofline, decode_work, step_work
from pagefleet.worker.simulated.sizing import (
    ReplicaShape,
    active_params_per_token,
    num_params,
    size_gpu,
    step_roofline,
)

HOURS_PER_MONTH = 730  # 365 * 24 / 12


@dataclass(frozen=True, slots=True)
class Lengths:
    """Prompt and output tokens per request, each uniform on [L(1 - r), L(1 + r)] as in the
    bench's random dataset (r = 0: every request the same)."""

    input_len: int
    output_len: int
    range_ratio: float = 0.0

    def bounds(self, length: int) -> tuple[int, int]:
        lo, hi = math.floor(length * (1 - self.range_ratio)), math.ceil(length * (1 + self.range_ratio))
        return max(lo, 1), max(hi, 1)

    @property
    def mean_context(self) -> float:
        """Mean tokens in a sequence's KV during its decode: the prompt and half the output."""
        return self.input_len + self.output_len / 2


@dataclass(frozen=True, slots=True)
class CostInputs:
    gpu_hour_price: float
    requests_per_day: float
    mean_prompt_tokens: int
    mean_output_tokens: int
    reasoning_multiplier: float = 1.0  # tokens generated per visible output token (hidden reasoning)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    model: ModelShape
    gpu: GPUSpec | None  # None: a CPU engine, whose budget is kv_cache_bytes
    num_gpus: int
    tensor_parallel_size: int
    dtype: str
    kv_cache_dtype: str
    gpu_memory_utilization: float
    kv_cache_bytes: int | None
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    lengths: Lengths
    cost: CostInputs | None = None

    @property
    def replica(self) -> ReplicaShape:
        """What sizes one GPU of a replica, as the engine sizes it."""
        return ReplicaShape(self.model, self.gpu, self.tensor_parallel_size, self.dtype, self.kv_cache_dtype,
                            self.gpu_memory_utilization, self.kv_cache_bytes, self.block_size,
                            self.max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class DecodeStep:
    batch: int
    bytes_read: int       # per GPU
    flops: float          # per GPU
    ms: float             # the slower of the memory and compute times
    bound: str            # "memory" or "compute"
    tokens_per_s_per_seq: float
    tokens_per_s_per_replica: float
    tokens_per_s_total: float
    experts_read: int = 0  # per MoE layer: min(experts, batch x experts per token)


@dataclass(frozen=True, slots=True)
class CostPlan:
    operating_batch: int
    prefill_s_per_request: float
    decode_s_per_request: float
    requests_per_s_per_replica: float
    replicas_needed: int
    gpus_needed: int
    tokens_per_day: float
    monthly_cost: float
    cost_per_million_tokens: float
    cost_per_million_output_tokens: float
    cost_per_million_tokens_at_full_load: float


@dataclass(frozen=True, slots=True)
class Plan:
    inputs: PlanInputs
    replicas: int
    num_params: int                   # what memory holds
    num_active_params: int            # what one token uses: all but the experts it was not routed to
    weight_bytes_per_gpu: int
    decode_weight_bytes_per_gpu: int  # every step reads all weights but the embedding table and the experts
    expert_bytes_per_gpu: int         # one expert of every MoE layer: a step reads those it routes to
    # The window the engine's KV manager frees blocks by (every layer slides), else None; and the
    # most tokens' KV one sequence of max_model_len holds at once under it.
    kv_sliding_window: int | None
    max_tokens_held_per_seq: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_token_per_replica: int
    kv_budget_source: str
    peak_estimate_bytes: int | None  # GPU only: weights + activations + profile scratch KV
    kv_budget_bytes_per_gpu: int
    num_blocks: int
    num_tokens: int
    kv_pool_bytes_per_gpu: int
    max_concurrency_at_max_model_len: float
    mean_blocks_per_request: float
    concurrent_requests_paged: int            # per replica, by KV blocks alone
    concurrent_requests_contiguous: int       # per replica, each reserving max_model_len
    paged_over_contiguous: float | None  # None where not one contiguous reservation fits (a window's pool)
    decode: list[DecodeStep] = field(default_factory=list)
    compute_bound_from_batch: int | None = None
    cost: CostPlan | None = None


def mean_blocks_per_request(lengths: Lengths, block_size: int, sliding_window: int | None = None) -> float:
    """E[ceil((prompt + output) / block_size)] with prompt and output independent and uniform:
    a request's blocks when it has all its tokens. With a window in every layer, the blocks it
    still holds then: the KV manager has given back those wholly before the window of its last
    token (``KVCacheManager.num_skipped_blocks`` after all but that token are computed)."""
    plo, phi = lengths.bounds(lengths.input_len)
    olo, ohi = lengths.bounds(lengths.output_len)
    if sliding_window is not None:
        return _mean_held_blocks(plo, phi, olo, ohi, block_size, sliding_window)

    def blocks_up_to(n: int) -> int:  # sum of ceil(x / block_size) for x in 1..n
        q, rem = divmod(n, block_size)
        return block_size * q * (q + 1) // 2 + rem * (q + 1)

    total = sum(blocks_up_to(prompt + ohi) - blocks_up_to(prompt + olo - 1) for prompt in range(plo, phi + 1))
    return total / ((phi - plo + 1) * (ohi - olo + 1))


def _mean_held_blocks(plo: int, phi: int, olo: int, ohi: int, block_size: int, window: int) -> float:
    held = [0] * (phi + ohi + 1)  # prefix sums over total lengths n of the blocks held at n tokens
    for n in range(1, phi + ohi + 1):
        held[n] = held[n - 1] + -(-n // block_size) - max(0, n - window) // block_size
    total = sum(held[prompt + ohi] - held[prompt + olo - 1] for prompt in range(plo, phi + 1))
    return total / ((phi - plo + 1) * (ohi - olo + 1))


def decode_step(roof: StepRoofline, batch: int, context: float, replicas: int) -> DecodeStep:
    """One decode step of ``batch`` sequences of ``context`` tokens on one GPU of a replica:
    it reads the weights once and each sequence's KV; it multiplies every weight per sequence."""
    cost = roof.cost(decode_work(batch, context))
    t = cost.seconds
    return DecodeStep(batch, int(cost.bytes_read), cost.flops, t * 1e3, cost.bound, 1 / t, batch / t,
                      replicas * batch / t, roof.experts_read(batch))


def make_plan(p: PlanInputs) -> Plan:
    m, tp = p.model, p.tensor_parallel_size
    if p.num_gpus % tp:
        raise ValueError(f"{p.num_gpus} GPUs do not split into replicas of tensor_parallel_size {tp}")
    if p.max_model_len > m.max_position_embeddings:
        raise ValueError(f"max_model_len {p.max_model_len} exceeds {m.name}'s limit of "
                         f"{m.max_position_embeddings} tokens")
    gpu = size_gpu(p.replica)
    # What the engine holds: a window in every layer caps a sequence's KV; a model mixing full and
    # sliding layers keeps all of it (the KV manager frees nothing while one layer reads it all).
    window = kv_sliding_window(m.sliding_windows)
    held = max_tokens_held(p.max_model_len, p.block_size, window, p.max_num_batched_tokens)
    pool = size_kv_pool(gpu.kv_budget_bytes, gpu.kv_bytes_per_block, p.block_size, p.max_model_len, held)

    lengths = p.lengths
    longest = lengths.bounds(lengths.input_len)[1] + lengths.bounds(lengths.output_len)[1]
    if longest > p.max_model_len:
        raise ValueError(f"the longest request ({longest} tokens) exceeds max_model_len {p.max_model_len}")
    mean_blocks = mean_blocks_per_request(lengths, p.block_size, window)
    paged = int(pool.num_blocks / mean_blocks)
    contiguous = pool.num_tokens // p.max_model_len
    replicas = p.num_gpus // tp

    kv_token = gpu.kv_bytes_per_token
    plan = Plan(p, replicas, num_params(m), active_params_per_token(m), gpu.weight_bytes, gpu.decode_weight_bytes,
                gpu.expert_bytes, window, held, kv_token, kv_token * tp,
                gpu.kv_budget_source, gpu.peak_estimate_bytes, gpu.kv_budget_bytes, pool.num_blocks,
                pool.num_tokens, pool.num_bytes, pool.max_concurrency(p.max_model_len), mean_blocks, paged, contiguous,
                paged / contiguous if contiguous else None)
    if p.gpu is None:
        return plan
    roof = step_roofline(p.replica, gpu)
    steps, compute_from = _roofline(p, plan, roof, min(paged, p.max_num_seqs))
    cost = _cost(p, plan, roof) if p.cost is not None else None
    return replace(plan, decode=steps, compute_bound_from_batch=compute_from, cost=cost)


def _roofline(p: PlanInputs, plan: Plan, roof: StepRoofline, max_batch: int) -> tuple[list[DecodeStep], int | None]:
    """Steps at batch 1, 2, 4, ... up to ``max_batch`` (what the pool and max_num_seqs allow),
    ending at the first compute-bound batch; and the smallest compute-bound batch, if any."""
    ctx = p.lengths.mean_context

    def step(b: int) -> DecodeStep:
        return decode_step(roof, b, ctx, plan.replicas)

    batches, b = [], 1
    while b < max_batch:
        batches.append(b)
        b *= 2
    batches.append(max_batch)
    steps = []
    for b in batches:
        steps.append(step(b))
        if steps[-1].bound == "compute":
            break
    first = next((s.batch for s in steps if s.bound == "compute"), None)
    if first is not None:  # the exact crossover lies between the last memory-bound batch and this one
        lo = steps[-2].batch if len(steps) > 1 else 0
        first = next(b for b in range(lo + 1, first + 1) if step(b).bound == "compute")
    return steps, first


def _cost(p: PlanInputs, plan: Plan, roof: StepRoofline) -> CostPlan:
    """Each replica serves requests back to back at the operating batch (what fits in its pool,
    at most max_num_seqs): a prefill step of the whole prompt, then decode steps, each at the
    roofline. An upper bound on throughput, so a lower bound on cost."""
    c = p.cost
    generated = c.mean_output_tokens * c.reasoning_multiplier
    request_blocks = -(-int(c.mean_prompt_tokens + generated) // p.block_size)
    batch = max(1, min(p.max_num_seqs, plan.num_blocks // request_blocks))
    prompt = c.mean_prompt_tokens
    prefill_s = roof.cost(step_work([(0, prompt)])).seconds
    step = decode_step(roof, batch, prompt + generated / 2, plan.replicas)
    decode_s = generated * step.ms / 1e3 / batch
    rps = 1 / (prefill_s + decode_s)
    replicas = max(1, math.ceil(c.requests_per_day / 86400 / rps))
    gpus = replicas * p.tensor_parallel_size
    tokens_per_day = c.requests_per_day * (c.mean_prompt_tokens + c.mean_output_tokens)
    monthly = gpus * c.gpu_hour_price * HOURS_PER_MONTH
    days = HOURS_PER_MONTH / 24
    full_load = c.gpu_hour_price * p.tensor_parallel_size / (rps * 3600 * (prompt + c.mean_output_tokens) / 1e6)
    return CostPlan(batch, prefill_s, decode_s, rps, replicas, gpus, tokens_per_day, monthly,
                    monthly / (tokens_per_day * days / 1e6),
                    monthly / (c.requests_per_day * c.mean_output_tokens * days / 1e6), full_load)
