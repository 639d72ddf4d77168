"""Tensor-parallel linears. With one rank they are plain ``nn.Linear``s and nothing distributed is imported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """This shard's place in a tensor-parallel group; ``group`` is the torch.distributed process group
    of its ranks (None: the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} outside [0, {self.size})")

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} does not split over TP size {self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x


    def failed_rank(self, failed: bool, device: torch.device) -> int | None:
        """The highest rank that says ``failed``, or None (every rank must call it, as with any collective)."""
        if self.size == 1:
            return self.rank if failed else None
        import torch.distributed as dist

        t = torch.tensor([self.rank + 1 if failed else 0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item()) - 1 if t.item() else None


class ColumnParallelLinear(nn.Linear):
    """Output features split over the TP ranks; each rank computes its slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, **kw):
        super().__init__(in_features, tp.split(out_features, "out_features"), bias=bias, **kw)


class RowParallelLinear(nn.Linear):
    """Input features split over the TP ranks; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, **kw):
        super().__init__(tp.split(in_features, "in_features"), out_features, bias=False, **kw)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))
