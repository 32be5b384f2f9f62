"""The time of one forward step on one GPU at the roofline: the slower of its bytes over the
memory bandwidth and its FLOPs over the peak. ``pagefleet plan``'s decode and prefill figures
and the simulated engine's step time (``worker/model_executor/simulated_runner.py``) both come
from here, so they cannot disagree.

A step computes, for each scheduled sequence, the tokens at positions ``[start, end)``: it reads
every weight but the embedding table once, and the KV of each sequence's ``end`` tokens; every
new token multiplies every matmul weight (2 FLOPs a weight) and attends to itself and the tokens
before it (4 FLOPs a key, head dimension and layer: QK^T and PV). Tensor-parallel communication,
kernel launches and the embedding gather are not counted.

A mixture-of-experts layer reads only the experts its tokens were routed to: a step of T tokens,
each running k of E experts, reads min(E, T x k) experts' weights in each MoE layer (every token
picking experts no other token picked: the bound, reached in full from E / k tokens on). So MoE
decode at batch 1 reads the weights of its active parameters, and its bytes grow with the batch
until every expert is read, where a dense model's stay flat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True, slots=True)
class StepCost:
    bytes_read: float  # per GPU
    flops: float       # per GPU
    seconds: float     # the slower of the memory and compute times
    bound: str         # "memory" or "compute"


@dataclass(frozen=True, slots=True)
class StepWork:
    """What a step computes, summed over its sequences."""

    num_tokens: int          # new tokens
    context_tokens: float    # KV tokens read: each sequence's end position
    attention_keys: float    # (query, key) pairs: a token at position q attends q + 1 keys


def step_work(chunks: Iterable[tuple[int, int]]) -> StepWork:
    """The work of a step whose sequences compute positions ``[start, end)`` each."""
    tokens = context = keys = 0
    for start, end in chunks:
        tokens += end - start
        context += end
        keys += (end * (end + 1) - start * (start + 1)) // 2
    return StepWork(tokens, context, keys)


def decode_work(batch: int, context: float) -> StepWork:
    """``batch`` sequences decoding one token each at ``context`` tokens (a mean may be fractional):
    the token at position context - 1 attends ``context`` keys."""
    return StepWork(batch, batch * context, batch * context)


@dataclass(frozen=True, slots=True)
class StepRoofline:
    """One GPU of a replica, as a step's time sees it."""

    weight_bytes: int             # read once a step: every weight but the embedding table and the experts
    matmul_params: int            # multiplied by every new token (the LM head included; a token's experts)
    kv_bytes_per_token: int       # this GPU's KV heads
    attention_flops_per_key: int  # 4 x this GPU's heads x head_dim x layers
    bandwidth: float              # bytes/s
    peak_flops: float             # FLOP/s at the weights' dtype
    expert_bytes: int = 0         # one expert's weights in every MoE layer, on this GPU
    num_experts: int = 0
    num_experts_per_tok: int = 0

    def experts_read(self, num_tokens: int) -> int:
        """Experts whose weights a step of ``num_tokens`` tokens reads in each MoE layer."""
        return min(self.num_experts, num_tokens * self.num_experts_per_tok)

    def cost(self, work: StepWork) -> StepCost:
        bytes_read = (self.weight_bytes + self.experts_read(work.num_tokens) * self.expert_bytes
                      + work.context_tokens * self.kv_bytes_per_token)
        flops = 2 * self.matmul_params * work.num_tokens + self.attention_flops_per_key * work.attention_keys
        t_mem, t_comp = bytes_read / self.bandwidth, flops / self.peak_flops
        return StepCost(bytes_read, flops, max(t_mem, t_comp), "compute" if t_comp > t_mem else "memory")
