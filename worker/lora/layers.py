"""LoRA beside a tensor-parallel linear: GPU slots of adapter weights, and the step's products.

A linear that takes LoRA holds a ``LoRALinear`` (``lora``); after its own product it calls
``lora.add_to(x, y)``, which adds, for each adapter in the step, ``(x_s @ A.T) @ B.T * scaling``
to the rows ``s`` that adapter's sequences own (the shrink and the expand, as PEFT computes them).
This is the PyTorch path: one gather and one add back per linear, two small matmuls per
adapter segment; a kernel over all segments at once (Triton, and a CPU one) is a later step.

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
class LoRAMapping:
    """A step's LoRA rows, sorted by adapter so that each adapter's rows are one segment: every
    LoRA layer gathers them once, runs each segment's shrink and expand on a slice, scales them
    by row and adds them back once."""

    rows: torch.Tensor           # [n] int64: the step's token rows that run an adapter, by segment
    scalings: torch.Tensor       # [n, 1]: each row's adapter scaling
    segments: list[tuple[int, int, int]]  # (slot, start, end) into ``rows``


class LoRABatch:
    """The step's mapping, shared by every LoRA layer of a model: set for one forward only, by the
    runner (``step``), and never nested."""

    def __init__(self) -> None:
        self._mapping: LoRAMapping | None = None

    @contextmanager
    def step(self, mapping: LoRAMapping) -> Iterator[None]:
        if self._mapping is not None:
            raise RuntimeError("a LoRA step is already running: steps do not nest")
        self._mapping = mapping
        try:
            yield
        finally:
            self._mapping = None

    @property
    def mapping(self) -> LoRAMapping | None:
        return self._mapping


class LoRALinear(nn.Module):
    """The adapters' weights for one linear, in ``max_loras`` slots. ``out_sizes``: the rank-local
    output parts (q|k|v, gate|up, or one); ``in_features``: the rank-local input features.

    A slot holds every part's A stacked ([parts x max_rank, in]) and their B as one block-diagonal
    matrix ([sum(out_sizes), parts x max_rank]), so an adapter costs one shrink and one expand per
    linear whatever its parts: the zero blocks (a lower rank, a part it does not target) add
    exact zeros."""

    def __init__(self, in_features: int, out_sizes: list[int], max_loras: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.batch = batch
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.max_rank = max_rank
        parts = len(out_sizes)
        self.register_buffer("lora_a", torch.zeros(max_loras, parts * max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, sum(out_sizes), parts * max_rank, dtype=dtype,
                                                   device=device), persistent=False)
        self.scalings: list[float | None] = [None] * max_loras  # None: the slot adds nothing here

    def set_slot(self, slot: int, rank: int, scaling: float,
                 weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter in ``slot``: ``weights`` by part, (A [r, in], B [out, r]) of this rank's shard."""
        self.clear_slot(slot)
        for part, (a, b) in weights.items():
            col, off = part * self.max_rank, self.offsets[part]
            self.lora_a[slot, col:col + rank].copy_(a)
            self.lora_b[slot, off:off + self.out_sizes[part], col:col + rank].copy_(b)
        self.scalings[slot] = scaling if weights else None

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scalings[slot] = None

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x: [T, in]; y: [T, sum(out_sizes)], the base product, added to in place
        mapping = self.batch.mapping
        if mapping is None:
            return y
        targeted = [(slot, start, end) for slot, start, end in mapping.segments if self.scalings[slot] is not None]
        if not targeted:
            return y
        xs = x.index_select(0, mapping.rows)                                        # [n, in]
        delta = torch.zeros(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)  # [n, sum(out_sizes)]
        for slot, start, end in targeted:
            shrunk = xs[start:end] @ self.lora_a[slot].t()                          # [rows, parts x max_rank]
            torch.mm(shrunk, self.lora_b[slot].t(), out=delta[start:end])
        # The rows are distinct: a gather, an add and a copy back (CPU's index_add_ is a scatter-add,
        # far slower for a few rows)
        y.index_copy_(0, mapping.rows, y.index_select(0, mapping.rows) + delta * mapping.scalings)
        return y
