"""LoRA beside a tensor-parallel linear: GPU slots of adapter weights, and the step's products.

A linear that takes LoRA holds a ``LoRALinear`` (``lora``); after its own product it calls
``lora.add_to(x, y)``, which adds, for each adapter in the step, ``(x_s @ A.T) @ B.T * scaling``
to the rows ``s`` that adapter's sequences own (the shrink and the expand, as PEFT computes them).
This is the PyTorch path: one gather, two small matmuls and one scatter-add per adapter and
projection part; a Triton kernel over all segments at once is a later step.

Sharding follows the base layer: a column-parallel linear holds B's rows of its output shard
(A whole); a row-parallel one holds A's columns of its input shard (B whole), its partial sums
joining the base layer's in the same all-reduce.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class LoRASegment:
    """The rows of the step one adapter's sequences own."""

    slot: int
    rows: torch.Tensor  # [n] int64 token rows of the step


class LoRABatch:
    """The step's segments, shared by every LoRA layer of a model: set for one forward only,
    by the runner (``step``), and never nested."""

    def __init__(self) -> None:
        self._segments: list[LoRASegment] | None = None

    @contextmanager
    def step(self, segments: list[LoRASegment]) -> Iterator[None]:
        if self._segments is not None:
            raise RuntimeError("a LoRA step is already running: steps do not nest")
        self._segments = segments
        try:
            yield
        finally:
            self._segments = None

    @property
    def segments(self) -> list[LoRASegment]:
        return self._segments or []


class LoRALinear(nn.Module):
    """The adapters' weights for one linear, in ``max_loras`` slots. ``out_sizes``: the rank-local
    output parts (q|k|v, gate|up, or one); ``in_features``: the rank-local input features."""

    def __init__(self, in_features: int, out_sizes: list[int], max_loras: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.batch = batch
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        parts = len(out_sizes)
        # lora_a: [slots, parts, max_rank, in]; lora_b_<i>: [slots, out_i, max_rank]
        self.register_buffer("lora_a", torch.zeros(max_loras, parts, max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        for i, size in enumerate(out_sizes):
            self.register_buffer(f"lora_b_{i}", torch.zeros(max_loras, size, max_rank, dtype=dtype, device=device),
                                 persistent=False)
        # Per slot: the adapter's rank and scaling, and which parts it targets (others add nothing).
        self.ranks = [0] * max_loras
        self.scalings = [0.0] * max_loras
        self.parts: list[tuple[int, ...]] = [()] * max_loras

    def set_slot(self, slot: int, rank: int, scaling: float,
                 weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter in ``slot``: ``weights`` by part, (A [r, in], B [out, r]) of this rank's shard."""
        self.clear_slot(slot)
        for part, (a, b) in weights.items():
            self.lora_a[slot, part, :rank].copy_(a)
            getattr(self, f"lora_b_{part}")[slot, :, :rank].copy_(b)
        self.ranks[slot], self.scalings[slot], self.parts[slot] = rank, scaling, tuple(sorted(weights))

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        for i in range(len(self.out_sizes)):
            getattr(self, f"lora_b_{i}")[slot].zero_()
        self.ranks[slot], self.scalings[slot], self.parts[slot] = 0, 0.0, ()

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x: [T, in]; y: [T, sum(out_sizes)], the base product, added to in place
        for seg in self.batch.segments:
            slot = seg.slot
            if not self.parts[slot]:
                continue
            rank, scaling = self.ranks[slot], self.scalings[slot]
            xs = x.index_select(0, seg.rows)
            for part in self.parts[slot]:
                shrunk = xs @ self.lora_a[slot, part, :rank].t()                                # [n, r]
                delta = (shrunk @ getattr(self, f"lora_b_{part}")[slot, :, :rank].t()) * scaling  # [n, out_i]
                off = self.offsets[part]
                y[:, off:off + self.out_sizes[part]].index_add_(0, seg.rows, delta)
        return y
