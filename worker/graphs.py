"""CUDA graphs of the decode step: one token per sequence, batch padded to a bucket, replayed instead of
launching ~45 kernels per layer from Python.

Only for backends that read the cache where it is: by slot and length (fa2, flash_attn over the virtual
cache) or through block tables (flash_attn_paged), which fit in fixed buffers; a gather needs a variable
number of rows. Padding rows read and write one token of a scratch slot.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

import torch

from worker.attention import AttentionBackend, AttentionMetadata, AttentionStep
from worker.model import Transformer
from worker.parallel import TPGroup
from worker.rope import rope_for
from worker.staging import to_device

logger = logging.getLogger(__name__)

#: Batch sizes decode graphs are captured for; eager steps pad their logits' rows to them too.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def padded_rows(n: int) -> int:
    """The bucket ``n`` rows are padded to: the smallest of ``BATCH_BUCKETS`` that holds them, past the
    largest a multiple of 128."""
    return next((b for b in BATCH_BUCKETS if b >= n), -(-n // 128) * 128)


class StepGraphs(ABC):
    """What the kinds of step graphs share: every size captured at once (``capture``: the worker calls it at its first
    message, ``run`` at its first step where nobody did), the largest first into one memory pool, in lock-step with
    the other TP ranks; a subclass says what a size's step runs (``_forward``) and what its inputs hold while nothing
    real is in them (``_pad_all``)."""

    def __init__(self, model: Transformer, cache, backend: AttentionBackend, rope_table: torch.Tensor, sizes,
                 scratch: int, tp: TPGroup):
        self.model, self.cache, self.backend, self.rope_table, self.tp = model, cache, backend, rope_table, tp
        self.dtype = next(model.parameters()).dtype
        self.device = rope_table.device
        self.sizes = sorted(set(sizes))
        self.scratch = scratch
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def close(self) -> None:
        """Release the graphs (before the process group they captured collectives of goes: destroying it while they
        live hung on 2xH200)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def capture(self) -> None:
        """Capture every size, unless done already (``run`` does it at its first step, before that step's inputs go
        in: the captures pad them all). A capture that fails leaves none: the next call tries them all again."""
        if self.graphs:
            return
        try:
            self._capture_all()
        except BaseException:
            self.close()
            raise

    def _replay(self, size: int) -> torch.Tensor:
        self.graphs[size].replay()
        return self.outputs[size]

    def _capture_all(self) -> None:
        """Every size's graph at once, over padding only: a capture takes 40-150 ms (H100), which the first steps of a
        size would otherwise wait for, mid-run."""
        start = time.perf_counter()
        self._pad_all()
        for size in reversed(self.sizes):  # the largest first: smaller ones fit in its memory pool
            self._capture(size)
        self.tp.barrier(self.device)  # no rank replays a graph while another still captures (NCCL hangs: 2xH200)
        logger.debug("captured %d %s in %.0f ms", len(self.sizes), type(self).__name__, 1e3 * (time.perf_counter() - start))

    @abstractmethod
    def _pad_all(self) -> None:
        """Fill the inputs with padding only, what every capture runs over."""

    @abstractmethod
    def _forward(self, size: int) -> torch.Tensor:
        """The step of ``size`` rows over the inputs, as the graph replays it; its output."""

    def _capture(self, size: int) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph: kernel selection, workspace allocation
                self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # NCCL collectives must not run eagerly on one rank while another captures them: every rank's warm-up done
        # first.
        self.tp.barrier(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._forward(size)
        self.pool = graph.pool()
        self.graphs[size] = graph


class DecodeGraphs(StepGraphs):
    def __init__(
        self, model: Transformer, cache, backend: AttentionBackend, rope_table: torch.Tensor, max_batch: int, scratch: int,
        tp: TPGroup = TPGroup(), logits: bool = True,
    ):
        """``scratch``: a slot the caller holds, one token backed, where padding rows read and write. With ``tp``
        of several ranks each rank captures its shard's graphs, the all-reduces inside them, in lock-step with the
        others (``_capture``): every rank must replay them for the same steps, whether it samples or not.
        ``logits=False``: a rank whose peer samples; its graphs end at the layers (no LM head). A pipeline stage
        after the first replays its layers over the previous stage's output (``run``'s ``hidden``); one before the
        last ends at its layers too."""
        super().__init__(model, cache, backend, rope_table, [min(b, max_batch) for b in BATCH_BUCKETS] + [max_batch],
                         scratch, tp)
        self.with_logits = logits and model.is_last
        # Rows: token, position, slot. Everything else the step needs follows from them on the device (and,
        # for a paged cache, from the block tables).
        self.inputs = torch.zeros(3, max_batch, dtype=torch.long, device=self.device)
        self.hidden = None if model.is_first else torch.zeros(max_batch, model.config.hidden_size, dtype=self.dtype,
                                                              device=self.device)
        self.paged = backend.reads == "blocks"
        width = -(-cache.spec.max_tokens // cache.block_size) if self.paged else 0
        self.tables = torch.zeros(max_batch, width, dtype=torch.int32, device=self.device)

    def fits(self, chunks) -> bool:
        return len(chunks) <= self.sizes[-1] and all(len(c.token_ids) == 1 for c in chunks)

    def run(self, chunks, fill=None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Replay a decode step: ``[len(chunks), vocab]`` logits in the model's dtype (``Transformer.logits``), or
        the last layer's output without them (``logits=False``, a stage before the last: read it before the next
        replay); ``fill``: a ``TokenFill`` of tokens still on the device; ``hidden``: the previous stage's output,
        a row per chunk (a stage after the first)."""
        self.capture()
        b = len(chunks)
        size = next(s for s in self.sizes if s >= b)
        pad = size - b
        host = torch.tensor([
            [c.token_ids[0] for c in chunks] + [0] * pad,
            [c.start for c in chunks] + [0] * pad,
            [c.slot for c in chunks] + [self.scratch] * pad,
        ])
        self.inputs[:, :size].copy_(to_device(host, self.device))
        if fill is not None:
            fill.apply(self.inputs[0], list(fill.chunks))
        if self.hidden is not None:
            self.hidden[:b].copy_(hidden, non_blocking=True)  # padding rows keep whatever they held: scratch reads it
        if self.paged:
            # Columns past a row's blocks keep stale ids, which the kernel never reads (it stops at the length).
            tables = self.cache.block_tables([c.slot for c in chunks] + [self.scratch] * pad)
            self.tables[:size, : tables.shape[1]].copy_(to_device(tables, self.device))
        return self._replay(size)[:b]

    def _pad_all(self) -> None:
        rows = len(self.inputs[0])
        self.inputs.copy_(torch.tensor([[0] * rows, [0] * rows, [self.scratch] * rows]))
        if self.paged:
            tables = self.cache.block_tables([self.scratch] * rows)
            self.tables[:, : tables.shape[1]].copy_(tables)

    def _forward(self, size: int) -> torch.Tensor:
        tokens, positions, slots = self.inputs[:, :size]
        if self.paged:  # token t of a slot is row b * block_size + t % block_size, b its table's (t // block_size)th
            stride = self.cache.block_size
            tables = self.tables[:size]
            block = tables.gather(1, (positions // stride)[:, None])[:, 0].long()
            write_rows = block * stride + positions % stride
            starts = torch.zeros_like(positions)  # slot offsets: read by the in-place slot kernels only
        else:  # a virtual cache: token t of slot s is row s * slot_tokens + t (the layout of cache.token_rows)
            stride = self.cache.spec.slot_tokens
            tables = None
            starts = slots * stride
            write_rows = starts + positions
        starts32 = starts.to(torch.int32)
        seq_starts = torch.cat([starts32, starts32[-1:]])
        meta = AttentionMetadata(
            seqs=(),
            write_rows=write_rows,
            kv_rows=None,
            cu_seqlens_q=torch.arange(size + 1, device=self.device, dtype=torch.int32),
            cu_seqlens_k=seq_starts,  # read only by gathering backends, which never run in a graph
            seq_starts=seq_starts,
            seqused_k=(positions + 1).to(torch.int32),
            slots=slots.to(torch.int32),
            slot_tokens=stride,
            max_query_len=1,
            max_kv_len=self.cache.spec.max_tokens,
            block_tables=tables,
        )
        x = tokens if self.hidden is None else self.hidden[:size]
        hidden = self.model(x, rope_for(self.rope_table, positions, self.dtype), AttentionStep(self.cache, self.backend, meta))
        return self.model.logits(hidden) if self.with_logits else hidden
