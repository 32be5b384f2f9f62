"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss): a router picks each token's top-k
experts, whose SwiGLU MLPs run as one fused op over tokens sorted by expert (``Kernels.fused_moe``).
gpt-oss adds biases to the router and the experts, clamps its SwiGLU, and ships its experts in
MXFP4, dequantized here as they load.

Tensor parallelism shards every expert's intermediate dimension, as the dense MLP's: each rank
holds gate|up rows and down columns of its slice of every expert, and the partial sums meet in
the all-reduce at the end of ``forward``. The router is replicated."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.kernels.ops import Kernels
from pagefleet.worker.model_executor.layers import TensorSlice
from pagefleet.worker.model_executor.quantization import dequantize_mxfp4
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
        self.packed_experts = None  # a CPU engine's oneDNN copies (cpu_linear.pack_linear_weights), after loading

    def load(self, kind: str, shard: int, src: TensorSlice) -> None:
        """``shard`` = 3 * expert + (0 gate, 1 up, 2 down); this rank reads only its slice."""
        expert, part = divmod(shard, 3)
        start, end = self.tp.rank * self.per_rank, (self.tp.rank + 1) * self.per_rank
        if part == 2:
            self.w2.data[expert].copy_(src[:, start:end])
        else:
            self.w13.data[expert, part * self.per_rank:(part + 1) * self.per_rank].copy_(src[start:end])


class Router(nn.Module):
    """The gate: one logit per expert for each token (replicated on every rank); gpt-oss's has a bias."""

    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(num_experts, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def load(self, kind: str, shard: int, src: TensorSlice) -> None:
        getattr(self, kind).data.copy_(src[:])


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
        out = self.kernels.fused_moe(x, self.experts.w13, self.experts.w2, topk_weights, topk_ids,
                                     packed=self.experts.packed_experts)
        return self.tp.all_reduce(out)

    def checkpoint_names(self, prefix: str, num_experts: int, names: tuple[str, str, str]) -> dict:
        """``prefix`` (e.g. "model.layers.3.mlp."): checkpoint name -> (module, kind, shard)."""
        table = {f"{prefix}gate.weight": (self.gate, "weight", 0)}
        for expert in range(num_experts):
            for part, name in enumerate(names):
                kind = "w2" if part == 2 else "w13"  # the parameter it fills (the loader checks it exists)
                table[f"{prefix}experts.{expert}.{name}.weight"] = (self.experts, kind, 3 * expert + part)
        return table


class GptOssExperts(FusedExperts):
    """gpt-oss's experts in ``FusedExperts``' layout, with biases ``w13_bias`` [E, 2*I_rank] (gate | up)
    and ``w2_bias`` [E, H]. The checkpoint interleaves gate and up (column 2j gate j, 2j + 1 up j)
    and stores each projection transposed ([E, H, 2I], [E, I, H]), or in MXFP4 as blocks and
    scales ([E, 2I, H/32, 16] and [E, 2I, H/32]; [E, H, I/32, 16] and [E, H, I/32]), which are
    dequantized to the model's dtype here, one expert at a time."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(num_experts, hidden, intermediate, tp, dtype, device)
        self.w13_bias = nn.Parameter(torch.zeros(num_experts, 2 * self.per_rank, dtype=dtype, device=device),
                                     requires_grad=False)
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        self._mxfp4_half: dict[str, torch.Tensor] = {}  # a projection's blocks or scales, until the other comes

    def load(self, kind: str, shard: int, src: TensorSlice) -> None:
        """``kind``: w13, w2, w13_bias or w2_bias; ``shard``: 0 full precision, 1 MXFP4 blocks, 2 MXFP4 scales."""
        start, end = self.tp.rank * self.per_rank, (self.tp.rank + 1) * self.per_rank
        if kind == "w2_bias":
            self.w2_bias.data.copy_(src[:])
            return
        if kind == "w13_bias":
            self._load_gate_up(self.w13_bias.data, src[:], 1, start, end)
            return
        blocks = scales = None
        if shard != 0:  # MXFP4: blocks and scales pair up, whichever the checkpoint lists first
            other = self._mxfp4_half.pop(kind, None)
            if other is None:
                self._mxfp4_half[kind] = src[:]
                return
            blocks, scales = (src, other) if shard == 1 else (other, src)
        dst = getattr(self, kind).data
        for expert in range(dst.shape[0]):
            if blocks is None:
                weight = src[expert:expert + 1][0].t()  # safetensors slices index by ranges
            else:
                weight = dequantize_mxfp4(blocks[expert:expert + 1][0], scales[expert:expert + 1][0], dst.dtype)
            # weight: [2I, H] (w13, interleaved rows) or [H, I] (w2)
            if kind == "w2":
                dst[expert].copy_(weight[:, start:end])
            else:
                self._load_gate_up(dst[expert], weight, 0, start, end)

    def _load_gate_up(self, dst: torch.Tensor, interleaved: torch.Tensor, dim: int, start: int, end: int) -> None:
        """interleaved: the checkpoint's 2I gate/up entries along ``dim`` (column 2j gate j, 2j + 1
        up j) -> dst's 2 * I_rank along ``dim``: this rank's gates, then its ups."""
        src, out = interleaved.movedim(dim, 0), dst.movedim(dim, 0)
        out[:self.per_rank].copy_(src[0::2][start:end])
        out[self.per_rank:].copy_(src[1::2][start:end])


class GptOssMoeBlock(nn.Module):
    """gpt-oss's MLP: the router's top-k logits (with its bias) softmaxed among themselves, as
    transformers' GptOssTopKRouter does, then the experts with biases and the clamped SwiGLU.
    Under tensor parallelism every rank holds the whole down bias and rank 0 alone adds it."""

    def __init__(self, cfg, tp: TPGroup, kernels: Kernels, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.tp = tp
        self.kernels = kernels
        self.swiglu_limit, self.swiglu_alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.mxfp4 = cfg.mxfp4_experts
        self.router = Router(cfg.num_experts, cfg.hidden_size, cfg.dtype, device, bias=True)
        self.experts = GptOssExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp, cfg.dtype,
                                     device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        logits = F.linear(x, self.router.weight, self.router.bias)  # [T, E]
        top_logits, topk_ids = logits.topk(self.top_k, dim=-1)  # [T, K]
        topk_weights = top_logits.softmax(dim=-1, dtype=torch.float32)
        experts = self.experts
        out = self.kernels.fused_moe(x, experts.w13, experts.w2, topk_weights, topk_ids, packed=experts.packed_experts,
                                     w13_bias=experts.w13_bias,
                                     w2_bias=experts.w2_bias if self.tp.rank == 0 else None,
                                     swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        return self.tp.all_reduce(out)

    def checkpoint_names(self, prefix: str) -> dict:
        """``prefix`` (e.g. "model.layers.3.mlp."): checkpoint name -> (module, kind, shard)."""
        e = f"{prefix}experts."
        table = {f"{prefix}router.weight": (self.router, "weight", 0), f"{prefix}router.bias": (self.router, "bias", 0),
                 f"{e}gate_up_proj_bias": (self.experts, "w13_bias", 0), f"{e}down_proj_bias": (self.experts, "w2_bias", 0)}
        for name, kind in (("gate_up_proj", "w13"), ("down_proj", "w2")):
            if self.mxfp4:
                table[f"{e}{name}_blocks"] = (self.experts, kind, 1)
                table[f"{e}{name}_scales"] = (self.experts, kind, 2)
            else:
                table[f"{e}{name}"] = (self.experts, kind, 0)
        return table
