"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts,
whose SwiGLU MLPs run as one fused op over tokens sorted by expert (``Kernels.fused_moe``).

Tensor parallelism shards every expert's intermediate dimension, as the dense MLP's: each rank
holds gate|up rows and down columns of its slice of every expert, and the partial sums meet in
the all-reduce at the end of ``forward``. The router is replicated."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.kernels.ops import Kernels
from pagefleet.worker.model_executor.layers import TensorSlice
from pagefleet.worker.parallel.tp_group import TPGroup

# What each architecture calls the block and its experts' three projections, in the order
# gate, up, down (the shard numbers ``FusedExperts.load`` reads).
EXPERT_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


class FusedExperts(nn.Module):
    """Every expert's weights stacked: ``w13`` [E, 2*I_rank, H] (gate | up), ``w2`` [E, H, I_rank]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        if intermediate % tp.size:
            raise ValueError(f"moe_intermediate_size {intermediate} does not split over "
                             f"tensor_parallel_size {tp.size}")
        self.tp = tp
        self.per_rank = intermediate // tp.size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.per_rank, hidden, dtype=dtype, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.per_rank, dtype=dtype, device=device),
                               requires_grad=False)

    def load(self, kind: str, shard: int, src: TensorSlice) -> None:
        """``shard`` = 3 * expert + (0 gate, 1 up, 2 down); this rank reads only its slice."""
        expert, part = divmod(shard, 3)
        start, end = self.tp.rank * self.per_rank, (self.tp.rank + 1) * self.per_rank
        if part == 2:
            self.w2.data[expert].copy_(src[:, start:end])
        else:
            self.w13.data[expert, part * self.per_rank:(part + 1) * self.per_rank].copy_(src[start:end])


class Router(nn.Module):
    """The gate: one logit per expert for each token (replicated on every rank)."""

    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)

    def load(self, kind: str, shard: int, src: TensorSlice) -> None:
        self.weight.data.copy_(src[:])


class SparseMoeBlock(nn.Module):
    def __init__(self, num_experts: int, top_k: int, norm_topk_prob: bool, hidden: int, intermediate: int,
                 tp: TPGroup, kernels: Kernels, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.tp = tp
        self.kernels = kernels
        self.gate = Router(num_experts, hidden, dtype, device)
        self.experts = FusedExperts(num_experts, hidden, intermediate, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        probs = F.linear(x, self.gate.weight).softmax(dim=-1, dtype=torch.float32)  # [T, E]
        topk_weights, topk_ids = probs.topk(self.top_k, dim=-1)  # [T, K]
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        out = self.kernels.fused_moe(x, self.experts.w13, self.experts.w2, topk_weights, topk_ids)
        return self.tp.all_reduce(out)

    def checkpoint_names(self, prefix: str, num_experts: int, names: tuple[str, str, str]) -> dict:
        """``prefix`` (e.g. "model.layers.3.mlp."): checkpoint name -> (module, kind, shard)."""
        table = {f"{prefix}gate.weight": (self.gate, "weight", 0)}
        for expert in range(num_experts):
            for part, name in enumerate(names):
                kind = "w2" if part == 2 else "w13"  # the parameter it fills (the loader checks it exists)
                table[f"{prefix}experts.{expert}.{name}.weight"] = (self.experts, kind, 3 * expert + part)
        return table
