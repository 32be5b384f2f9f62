"""Megatron-style tensor-parallel layers. Each knows how to cut its own shard out of a
checkpoint tensor (reading only that slice), and the all-reduce is a line in ``forward``.
With one rank they are plain linear layers."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.worker.core.kv_cache_sizing import kv_heads_per_rank
from pagefleet.worker.cpu.linear import PackedWeight, linear
from pagefleet.worker.lora.layers import LoRALinear
from pagefleet.worker.model_executor.fp8 import FP8_DTYPE, check_fp8_shape, fp8_linear, quantize_weight
from pagefleet.worker.parallel.tp_group import TPGroup


class TensorSlice(Protocol):
    """A lazily read checkpoint tensor (safetensors' ``get_slice`` or a tensor)."""

    def get_shape(self) -> list[int]: ...
    def __getitem__(self, index) -> torch.Tensor: ...


class QuantizableLinear(nn.Module):
    """What the tensor-parallel linears share: the product itself, plain or FP8 (fp8.py).

    An FP8 linear holds ``weight`` [out, in] in float8_e4m3fn and ``weight_scale`` [out] fp32,
    one scale per output row of this rank (so fused q|k|v and gate|up keep each part's own)."""

    weight: nn.Parameter
    packed_weight: PackedWeight | None
    # The adapters' products added to this linear's (worker/lora), where LoRA is enabled.
    lora: LoRALinear | None

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its FP8 copy and per-output-channel scales; the
        full-precision weight is freed (and never packed for oneDNN)."""
        weight, scale = quantize_weight(self.weight.data)
        check_fp8_shape(weight)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.packed_weight = None

    def hold_fp8_checkpoint(self) -> None:
        """Make room for a pre-quantized checkpoint's FP8 weight and its scales, loaded as they are."""
        check_fp8_shape(self.weight)
        self.weight = nn.Parameter(torch.empty_like(self.weight, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(self.weight.shape[0], dtype=torch.float32,
                                                     device=self.weight.device), requires_grad=False)
        self.packed_weight = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias, x.dtype)
        return linear(x, self.weight, bias, self.packed_weight)


def _load_scale(dst: torch.Tensor, src: TensorSlice, start: int, end: int) -> None:
    """dst: [end - start] rows of this rank's ``weight_scale``; src: a checkpoint's scale, per channel
    ([rows, 1] or [rows], rows start:end read) or per tensor ([1] or [], spread over every row)."""
    shape = list(src.get_shape() if hasattr(src, "get_shape") else src.shape)  # a slice or a tensor
    if shape in ([], [1], [1, 1]):
        dst.fill_(src[...].reshape(()).item())
    elif len(shape) in (1, 2) and shape[1:] in ([], [1]):
        dst.copy_(src[start:end].reshape(-1))
    else:
        raise ValueError(f"a weight_scale of shape {shape}: pagefleet loads per-channel ([out, 1]) or "
                         "per-tensor ([1]) FP8 weight scales")


class ColumnParallelLinear(QuantizableLinear):
    """Output features split over ranks; ``out_sizes`` are the rank-local sizes of the
    logical outputs merged into one matmul (q|k|v or gate|up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.tp = tp
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(sum(out_sizes), dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.packed_weight: PackedWeight | None = None  # cpu_linear.pack_linear_weights, after loading
        self.register_parameter("weight_scale", None)  # [out] fp32 once FP8 (QuantizableLinear)
        self.lora = None

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """Which rows of logical output ``shard``'s full checkpoint tensor this rank holds."""
        size = self.out_sizes[shard]
        return self.tp.rank * size, (self.tp.rank + 1) * size

    def load(self, kind: str, shard: int, src: TensorSlice) -> None:
        start, end = self.shard_rows(shard)
        dst = getattr(self, kind)
        off = self.offsets[shard]
        if kind == "weight_scale":
            _load_scale(dst.data[off:off + end - start], src, start, end)
            return
        dst.data[off:off + end - start].copy_(src[start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return y if self.lora is None else self.lora.add_to(x, y)


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v merged; query heads split over ranks, KV heads split or, when there are
    fewer KV heads than ranks, replicated (each rank keeps the one its query heads use)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(num_heads, num_kv_heads, tp.size)  # raises for bad splits
        self.total_kv_heads = num_kv_heads
        super().__init__(hidden, [self.num_heads * head_dim, self.num_kv_heads * head_dim,
                                  self.num_kv_heads * head_dim], bias, tp, dtype, device)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        if shard == 0 or self.total_kv_heads >= self.tp.size:
            return super().shard_rows(shard)
        head = self.tp.rank * self.total_kv_heads // self.tp.size
        return head * self.head_dim, (head + 1) * self.head_dim


class RowParallelLinear(QuantizableLinear):
    """Input features split over ranks; partial sums meet in an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split over tensor_parallel_size {tp.size}")
        self.tp = tp
        self.in_per_rank = in_features // tp.size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.packed_weight: PackedWeight | None = None
        self.register_parameter("weight_scale", None)  # [out] fp32 once FP8 (QuantizableLinear)
        self.lora = None

    def load(self, kind: str, shard: int, src: TensorSlice) -> None:
        if kind == "bias":
            self.bias.data.copy_(src[:])
            return
        if kind == "weight_scale":  # output rows are not split: every rank holds them all
            _load_scale(self.weight_scale.data, src, 0, self.weight_scale.shape[0])
            return
        start = self.tp.rank * self.in_per_rank
        self.weight.data.copy_(src[:, start:start + self.in_per_rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        if self.lora is not None:  # this rank's partial LoRA sums join the base layer's
            y = self.lora.add_to(x, y)
        y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias  # added once, after the sum
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over ranks (padded to a multiple of the rank count);
    each rank looks up the ids it owns, the all-reduce fills in the rest."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden, dtype=dtype, device=device),
                                   requires_grad=False)

    def load(self, kind: str, shard: int, src: TensorSlice) -> None:
        end = min(self.start + self.per_rank, self.vocab_size)
        if end > self.start:
            self.weight.data[:end - self.start].copy_(src[self.start:end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Same sharding as the embedding; logits are gathered on rank 0 only."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(vocab_size, hidden, tp, dtype, device)
        self.packed_weight: PackedWeight | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [S, H] -> [S, vocab] on rank 0, None elsewhere
        local = linear(hidden, self.weight, None, self.packed_weight)
        full = self.tp.gather_last_dim_to_first(local)
        return None if full is None else full[:, :self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)

    def load(self, kind: str, shard: int, src: TensorSlice) -> None:
        self.weight.data.copy_(src[:])
