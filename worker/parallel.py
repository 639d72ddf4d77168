"""Tensor-parallel linears. With one rank they are plain ``nn.Linear``s and nothing distributed is imported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker import batch_invariant
from worker.kernels import rms_norm


@dataclass(frozen=True)
class TPGroup:
    """This shard's place in a tensor-parallel group; ``group`` is the torch.distributed process group
    of its ranks (None: the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    # The same ranks over gloo (None: ``group`` itself): agreements between the ranks' hosts (``failed_rank``) that
    # must not queue behind the device's work, as a sum over NCCL does.
    cpu_group: Any = field(default=None, compare=False, repr=False)
    # Sums in rank order (``deterministic=True``): NCCL's ring and tree add a chunk's partial sums in an order
    # that depends on which chunk an element falls in, so on the tensor's size, so on the batch.
    ordered: bool = False
    # Small sums through peer memory (``PeerAllReduce``: one kernel, the ranks' parts added in rank order; with the
    # Lamport kernel in float32, as the ordered sum below, which at more than two ranks the one-shot kernel's 16-bit
    # adds would not match: ordered sums then leave it to NCCL); None: NCCL takes every sum.
    peer: Any = field(default=None, compare=False, repr=False)
    # > 0: a row-parallel product of at least this many rows (prefill chunks) is computed in two halves, the first
    # half's sum running on NCCL's stream while the second half's product runs (``RowParallelLinear``); 0: one
    # product, then its sum (EngineConfig.tp_overlap_rows: off, within noise on W1 at TP=2, 2xH200).
    overlap_rows: int = 0

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
        if self.peer is not None and self.peer.fits(x) and (not self.ordered or self.size == 2
                                                           or self.peer.sums_in_float32):
            return self.peer.all_reduce(x)
        import torch.distributed as dist

        if not self.ordered or self.size == 2:  # a + b == b + a: two ranks' sum is the same whatever the order
            dist.all_reduce(x, group=self.group)
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        # In float32, rounded once at the end, as the peer-memory kernel adds a smaller sum of the same rows: a row
        # gets the same bits whether its batch's sum fits in peer memory or not.
        total = parts[0].to(torch.promote_types(x.dtype, torch.float32))
        for part in parts[1:]:
            total += part
        return x.copy_(total)

    @property
    def fuses_norms(self) -> bool:
        """Whether a row-parallel product's sum waits for the RMSNorm after it, to run as one kernel with its residual
        add (``add_norm``): with the Lamport kernel's peer memory (the default), and no prefill
        products split in halves (``overlap_rows``), which sum themselves."""
        return self.size > 1 and getattr(self.peer, "lamport", None) is not None and not self.overlap_rows

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """``x`` (this rank's partial sum) summed over the ranks, plus ``residual``, and its RMSNorm: ``(h, normed)``,
        one kernel where the peer memory's takes them (``PeerAllReduce.fuses``), else the sum then the norm's kernel,
        with the same bits."""
        if self.peer.fuses(x, residual):
            return self.peer.all_reduce_norm(x, residual, weight, eps)
        return rms_norm(self.all_reduce(x), weight, eps, residual)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, rank 0's first (a vocabulary-parallel LM head's
        logits: each rank holds its slice of the vocabulary)."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def argmax_columns(self, x: torch.Tensor) -> torch.Tensor:
        """``gather_columns(x).argmax(-1)`` without gathering ``x``: each rank's best column and its value, exchanged
        (16 bytes a row), the first of the highest values -- the lowest rank among equals, as the whole row's argmax."""
        import torch.distributed as dist

        value, local = x.max(-1, keepdim=True)  # one reduction: the first of the highest, as ``argmax``
        # value and column in float64: a 16-bit or float32 value and a column below 2**53 both exact
        best = torch.cat([value.double(), (local + self.rank * x.shape[-1]).double()], -1)
        every = best.new_empty(self.size * best.shape[0], 2)  # rank-major: [rank, row, (value, column)] flat
        dist.all_gather_into_tensor(every, best, group=self.group)
        every = every.view(self.size, -1, 2)
        rank = every[..., 0].argmax(0, keepdim=True)
        return every[..., 1].gather(0, rank)[0].long()

    def barrier(self, device: torch.device) -> None:
        """Return once every rank's queued work on ``device`` is done and every rank got here."""
        if self.size == 1:
            return
        done = torch.zeros(1, device=device)
        self.all_reduce(done)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def failed_rank(self, failed: bool, device: torch.device) -> int | None:
        """The highest rank that says ``failed``, or None (every rank must call it, as with any collective). Over
        ``cpu_group`` where there is one: over NCCL the sum queues behind the step in flight, and reading it waits for
        that step, so every launch at TP > 1 waited for the device to finish the step before (2xH200)."""
        if self.size == 1:
            return self.rank if failed else None
        import torch.distributed as dist

        group, where = (self.cpu_group, "cpu") if self.cpu_group is not None else (self.group, device)
        t = torch.tensor([self.rank + 1 if failed else 0], device=where)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        highest = int(t.item())
        return highest - 1 if highest else None


class Linear(nn.Linear):
    """``nn.Linear`` whose product is the batch-invariant one (``worker.batch_invariant``) while
    ``batch_invariant`` is set (``Transformer.set_batch_invariant``)."""

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return batch_invariant.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """Output features split over the TP ranks; each rank computes its slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, **kw):
        super().__init__(in_features, tp.split(out_features, "out_features"), bias=bias, **kw)


class RowParallelLinear(Linear):
    """Input features split over the TP ranks; partial sums all-reduced, or left to the RMSNorm after it where the TP
    group fuses the two (``TPGroup.fuses_norms``)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, **kw):
        super().__init__(tp.split(in_features, "in_features"), out_features, bias=False, **kw)
        self.tp = tp
        self.sums_later = tp.fuses_norms  # decided once, with the model's blocks (``Block.sums_in_norms``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sums_later:
            return super().forward(x)  # this rank's part: the next norm sums it (``TPGroup.add_norm``)
        if (self.tp.size > 1 and 0 < self.tp.overlap_rows <= x.shape[0] and not self.batch_invariant
                and not (x.is_cuda and torch.cuda.is_current_stream_capturing())):  # a graph: one stream, one sum
            return self._overlapped(x)
        return self.tp.all_reduce(super().forward(x))

    def _overlapped(self, x: torch.Tensor) -> torch.Tensor:
        """The product in two halves of rows, each half's sum started as soon as it is computed: NCCL adds the
        first while the device computes the second (a prefill chunk's sums cost 12% of its step on 2xH200)."""
        import torch.distributed as dist

        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        half = x.shape[0] // 2
        pending = []
        for rows in (slice(0, half), slice(half, None)):
            torch.matmul(x[rows], self.weight.t(), out=out[rows])
            pending.append(dist.all_reduce(out[rows], group=self.tp.group, async_op=True))
        for work in pending:
            work.wait()  # the current stream waits for the sums; the host does not
        return out
