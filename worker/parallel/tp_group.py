"""A tensor-parallel group as the layers see it: rank, size, and the visible collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=dist.get_global_rank(self.group, 0) if self.group else 0,
                    group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE = TPGroup()
