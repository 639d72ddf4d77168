"""Worker: one model shard (a TP rank of a PP stage) with its own KV cache, async mapper and swap space.

It applies each step's KV operations exactly as its scheduler recorded them, queues the step's kernels, then
hands the next step's mapping plan to its mapper, which maps while the device runs the step. The same class runs
in-process and inside a Ray actor.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvmem import AsyncMapper, KVCacheSpec, MappingPlan, PagedKVCache, VirtualKVCache, default_vmm
from kvmem.ops import AllocSlot, DropKept, Ensure, FreeSlot, FusePrefix, KeepPage, MapKept, apply_ops
from kvmem.swap import SwapSpace
from worker.attention import get_backend
from worker.loader import build_model
from worker.messages import PLACEHOLDER, NewSeq, StepInput, WorkerReport
from worker.model import Transformer
from worker.parallel import TPGroup
from worker.peer_all_reduce import PeerAllReduce
from worker.profiler import StepProfiler
from worker.runner import LaunchedStep, ModelRunner, ScheduledChunk, StepOutput, StepPlan, TokenFill

logger = logging.getLogger(__name__)
# KV operations a step may apply while the step before it is still queued: they map only into slots no queued work
# reads (a new slot; a freed one's pages wait for its own fence), copy on the stream after it, or only count
# references (the prefix cache's holds: a page only the cache holds is mapped nowhere). A fused prefix's copy reads
# its source slot on the stream after that step, and the source keeps its mappings until the copy is done.
UNFENCED = (Ensure, AllocSlot, FreeSlot, KeepPage, MapKept, FusePrefix, DropKept)


@dataclass(frozen=True)
class PendingOutput:
    """A step ``Worker.launch`` queued; ``Worker.finish`` reads its result."""

    step: int
    launched: LaunchedStep | None  # None: a step without a batch (KV operations only)
    ahead: MappingPlan | None


class PeerFailed(RuntimeError):
    """Another TP rank of this stage could not apply a step; this rank stops with it."""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one shard needs to build itself; the scheduler makes one per (pp stage, tp rank)."""

    model: str  # preset name or Hugging Face model directory
    dtype: torch.dtype
    device: str
    kv_spec: KVCacheSpec  # this shard's layers and heads
    pool_bytes: int | None  # None: sized once the weights are in (``Worker.kv_memory_available``, ``allocate``)
    attention: str
    layers: range
    pp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    graph_batch: int = 0  # > 0: CUDA-graph decode steps up to this batch
    scratch_slot: int | None = None  # the graphs' padding slot (the scheduler holds it in its ledger)
    swap: bool = False
    deferred_reclamation: bool = True  # a virtual cache's freed slots keep their pages (the ledger does the same)
    zero_unmapped: bool = False  # a virtual cache maps a read-only zero page over its unmapped space
    kv_guard_tokens: int | None = None  # ... only over this many tokens past each slot's pages (None: all of it)
    seed: int = 0
    progress: bool = False
    load_format: str = "auto"  # "dummy": random weights at the model directory's shape
    # Async scheduling: a step's input may end a sequence's chunk with ``PLACEHOLDER``, the token this worker
    # sampled for it last (the scheduler has not seen it yet); so every TP rank samples.
    fills_placeholders: bool = False
    # Pipeline stages in a token ring (``pipeline_handoff="ring"``): every TP rank of the last stage samples, to hand
    # its tokens back to its counterpart in the first stage, which fills placeholders with them (``hand``).
    token_ring: bool = False
    deterministic: bool = False  # batch-invariant matmuls and all-reduce (the plan picks the invariant attention)
    custom_all_reduce: bool = True  # TP on GPUs: small sums through peer memory (``PeerAllReduce``) where it works
    tp_overlap_rows: int = 0  # ``TPGroup.overlap_rows``
    warm_rows: int = 0  # > 0 (CUDA): the projections run at row counts up to this at start (``warm_projections``)
    mixed_graph_tokens: int = 0  # > 0 with graph_batch: steps that prefill, up to this many tokens, in graphs (``MixedGraphs``)


class Worker:
    def __init__(self, config: WorkerConfig, model: Transformer | None = None, tp_group=None, tp_cpu_group=None):
        """``model``: an already built shard (in-process use); ``tp_group``: the torch.distributed group
        of this stage's TP ranks when ``tp_size`` > 1, ``tp_cpu_group`` the same ranks over gloo (``TPGroup``)."""
        self.config = config
        self.device = torch.device(config.device)
        self._backend = get_backend(config.attention, self.device)  # a missing package fails before weights load
        if self.device.type == "cuda" and self.device.index is None:  # the one this process selected (a Ray actor's)
            self.device = torch.device("cuda", torch.cuda.current_device())
        tp = TPGroup(config.tp_rank, config.tp_size, tp_group, tp_cpu_group, ordered=config.deterministic,
                     overlap_rows=config.tp_overlap_rows)
        if config.tp_size > 1 and self.device.type == "cuda" and config.custom_all_reduce:
            tp = replace(tp, peer=PeerAllReduce.connect(tp, self.device))
        self.tp = tp
        self.model = model or build_model(config.model, config.dtype, self.device, tp, config.layers, config.seed,
                                          config.progress, config.load_format)
        self.model.set_batch_invariant(config.deterministic)  # a model handed in may have run in the other mode
        self.cache = None
        if config.pool_bytes is not None:
            self.allocate(config.pool_bytes)
        self._seqs: dict[int, NewSeq] = {}
        self._last: dict[int, int] = {}  # seq_id -> the token last sampled for it (fills placeholders)
        self._handed: tuple[torch.Tensor, dict[int, int]] | None = None  # a token ring's last tokens (``hand``)
        self._reported_maps = 0
        self._busy = 0.0
        self._device = 0.0  # device time of the steps finished (CUDA)
        self._in_flight: PendingOutput | None = None  # launched, its result not read yet
        self.profiler = StepProfiler(self.device)

    def kv_memory_available(self, fraction: float | None, sharers: int, utilization: float | None = None) -> int:
        """Bytes of KV memory this worker could take: ``fraction`` of what its device has free now that its
        weights are in, or with ``utilization`` (a GPU's) what is free beyond ``1 - utilization`` of its whole
        memory. On CPU the host's available memory is split between the ``sharers`` workers."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks the loader freed are free, though torch's allocator still holds them
            free, total = torch.cuda.mem_get_info(self.device)
            if utilization is not None:
                return max(0, int(free - (1 - utilization) * total))
        else:
            import psutil  # only CPU workers ask the host

            free = psutil.virtual_memory().available // sharers
        return int(fraction * free)

    def allocate(self, pool_bytes: int) -> None:
        """Create the KV cache with ``pool_bytes`` of physical pages, then what runs over it (the runner, its
        CUDA graphs captured; swap space; the mapper)."""
        if self.cache is not None:
            raise RuntimeError(f"worker pp{self.config.pp_rank} tp{self.config.tp_rank} already has its KV cache")
        # A pool past what the device holds fails late and badly: on CPU its pages are committed as the pool is made,
        # and Ray's memory monitor (or the OOM killer) kills the worker then, and again at each restart. Pools made at
        # once each pass alone: a Ray engine checks its CPU workers' pools together first (``RayExecutor``).
        if pool_bytes > (available := self.kv_memory_available(1.0, 1)):
            raise ValueError(f"kv_memory: a KV pool of {pool_bytes / (1 << 30):.2f} GiB is more than worker "
                             f"pp{self.config.pp_rank} tp{self.config.tp_rank}'s {self.device.type} memory has free "
                             f"({available / (1 << 30):.2f} GiB): lower kv_memory, or size the pool with "
                             f"kv_memory_fraction")
        c = self.config = replace(self.config, pool_bytes=pool_bytes)
        if c.kv_spec.layout == "paged":
            self.cache = PagedKVCache(c.kv_spec, pool_bytes, self.device)
        else:
            # Pages let go of in a step's launch (a new request's, reclaiming free slots' pages the prefix cache no
            # longer holds) are unmapped by the mapper's thread once the step before is done (``finish``), not there.
            self.cache = VirtualKVCache(c.kv_spec, pool_bytes, default_vmm(self.device),
                                        deferred_reclamation=c.deferred_reclamation, zero_unmapped=c.zero_unmapped,
                                        guard_tokens=c.kv_guard_tokens, background_unmaps=True)
        try:
            self.runner = ModelRunner(self.model, self.cache, self._backend, self.device, c.graph_batch,
                                      c.scratch_slot, samples=c.tp_rank == 0 or c.fills_placeholders or c.token_ring,
                                      tp=self.tp,
                                      warm_rows=c.warm_rows, mixed_tokens=c.mixed_graph_tokens)
            self.swap = SwapSpace(self.cache) if c.swap else None
            self.mapper = AsyncMapper(self.cache)
            # The order before 2026-11-29, to measure against (``bench/peer.py``'s ``vattn-mapfirst``).
            self._map_during_launch = os.environ.get("VATTN_MAP_DURING_LAUNCH") == "1"
            self._graphs_ready = False  # the runner's CUDA graphs, captured at the first message (``launch``)
        except BaseException:
            self.cache.close()  # a failed allocation leaves no reservation behind
            self.cache = None
            raise

    @property
    def in_flight(self) -> PendingOutput | None:
        """The step launched last, while its result is not read yet."""
        return self._in_flight

    def execute(self, step: StepInput, inputs: torch.Tensor | None = None) -> StepOutput:
        """Apply the step's KV operations, map ahead while the step runs, run it."""
        return self.finish(self.launch(step, inputs))

    def launch(self, step: StepInput, inputs: torch.Tensor | None = None) -> PendingOutput:
        """Apply the step's KV operations and queue its kernels, without waiting for the device: a caller
        that launches step k+1 before it calls ``finish`` on step k keeps the device busy meanwhile. Chunks
        that end in a placeholder take the token step k drew on the device."""
        start = time.perf_counter()
        try:
            with self.profiler.step(step):
                return self._launch(step, inputs)
        finally:
            self._busy += time.perf_counter() - start

    def pass_on(self, step: StepInput, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """A pipeline stage before the last: queue the step and hand back its hidden states without waiting for the
        device (the hand-off to the next stage is queued behind its kernels), so the host takes the next micro-batch
        while they run; the step before is finished now. The pages this step maps ahead are mapped before it
        returns: between calls, this cache holds what the ledger says. None: a step without a batch."""
        before = self._in_flight
        pending = self.launch(step, inputs)
        if before is not None:
            self.finish(before)
        if pending.launched is None:
            return None
        start = time.perf_counter()
        try:
            self.mapper.wait(pending.ahead, record=False)  # the device is busy with the step meanwhile
        finally:
            self._busy += time.perf_counter() - start
        return pending.launched.done.hidden

    def supply_masks(self, pending: PendingOutput, masks: dict[int, bytes | None]) -> PendingOutput:
        """Queue the draw of a launched step that waits for grammar masks (its ``late_masks``; None: draw that
        sequence unmasked), before the next step is launched: that one reads the tokens drawn here. The step as
        ``finish`` takes it."""
        start = time.perf_counter()
        try:
            done = replace(pending, launched=self.runner.sample_late(pending.launched, masks))
            if self._in_flight is pending:
                self._in_flight = done
            return done
        finally:
            self._busy += time.perf_counter() - start

    def finish(self, pending: PendingOutput) -> StepOutput:
        """Wait for a launched step and read what it sampled; steps finish in the order they were launched."""
        start = time.perf_counter()
        try:
            if pending.launched is None:  # a step without a batch (frees after the last requests)
                self.mapper.clean()
                return StepOutput({})
            try:
                out = pending.launched.result()
                self.mapper.clean()  # what this step read and was let go of meanwhile: its mappings go now
                self._device += pending.launched.device_seconds
                if self.config.fills_placeholders:  # not for sequences that ended meanwhile (their state is gone)
                    self._last.update((s, drawn[0]) for s, drawn in out.sampled.items() if s in self._seqs)
                return out
            finally:
                if self._in_flight is pending:
                    self._in_flight = None
                # The scheduler sent only a plan that fits this pool: an error here means the ledger and this
                # cache disagree, which the caller must treat as fatal for the worker group.
                if (waited := self.mapper.wait(pending.ahead)) and logger.isEnabledFor(logging.DEBUG):
                    logger.debug("step %d: %.3f ms stall waiting for the pages mapped ahead of it", pending.step, 1e3 * waited)
        finally:
            self._busy += time.perf_counter() - start

    def _launch(self, step: StepInput, inputs: torch.Tensor | None) -> PendingOutput:
        prev = self._in_flight.launched if self._in_flight is not None else None
        if prev is not None and prev.awaits_masks:
            raise RuntimeError(f"step {step.step} launched before the grammar masks of the step in flight were supplied")
        error = None
        try:
            # Mapping waited for: the mapper's plan for the step before (its ensures must not race the operations
            # below), and pages mapped here that it did not map ahead.
            with self.profiler.phase("map_wait"):
                waited = self.mapper.wait(self._in_flight.ahead, record=False) if self._in_flight is not None else 0.0
            fence = prev.queued if prev is not None else None
            if fence is not None and any(not isinstance(op, UNFENCED) for op in step.kv_ops):
                # A swapped or shared slot is copied or remapped at once: only once no queued kernel reads it.
                fence.synchronize()
            for seq in step.new_seqs:
                self._seqs[seq.seq_id] = seq
                if seq.params.penalized:
                    self.runner.track(seq.seq_id, seq.prompt_token_ids, seq.output_token_ids)
            for seq_id in step.finished_seqs:
                self._seqs.pop(seq_id, None)
                self._last.pop(seq_id, None)
                self.runner.forget(seq_id)
            maps, fenced, started = self.cache.counters()[0], self.cache.fence_wait_seconds(), time.perf_counter()
            # A freed slot is not waited for here: the queued step (which may still read it) fences its pages,
            # and only a reclaim that unmaps them waits -- most steps free a slot once requests come and go.
            with self.profiler.phase("kv_ops"):
                apply_ops(self.cache, step.kv_ops, self.swap, fence)
            if self.cache.counters()[0] != maps:
                # Waiting for the queued step to finish is no stall (the device is busy); mapping after it is.
                waited += time.perf_counter() - started - (self.cache.fence_wait_seconds() - fenced)
            if waited and not (prev is not None and prev.running):  # a step still running hid the wait
                self.cache.add_stall(waited)
                logger.debug("step %d: %.3f ms stall mapping in the step", step.step, 1e3 * waited)
            with self.profiler.phase("plan"):
                plan = self._plan(step, prev)
        except Exception as exc:  # e.g. KVCacheExhausted: this cache and the ledger disagree
            error = exc
        # A rank that failed here would leave its TP peers waiting in the layers' all-reduces forever:
        # the ranks agree first, and all of them raise together.
        with self.profiler.phase("tp_agree"):
            failed = self.tp.failed_rank(error is not None, self.device)
        if failed is not None:
            c = self.config
            raise error or PeerFailed(f"TP rank {failed} of stage {c.pp_rank} failed step {step.step} (its log has why); "
                                      f"rank {c.tp_rank} stops with it")
        if not self._graphs_ready:
            # Once, at the first message (the engine's first flush: the scratch slot's page mapped by its operations),
            # every kind at once, and with the mapper idle -- a capture must meet no other thread's driver calls.
            self.mapper.drain()
            self.runner.capture_graphs()
            self._graphs_ready = True
        if not step.seq_ids:
            return PendingOutput(step.step, None, None)
        mapping = MappingPlan(step.ahead, *step.eager, prefixes=step.prefixes)
        # The next step's pages are mapped once this step's kernels are queued, not while they are: the mapper's
        # driver calls beside a launch can hold the kernels back, the device waiting inside the step (on the H200,
        # mapping prefixes ahead added 0.42 s of device time to peer.py's `prefix`, 15.3 s, in every process).
        ahead = self.mapper.submit(mapping) if self._map_during_launch else None
        try:
            with self.profiler.phase("queue"):
                launched = self.runner.launch(plan, inputs)
        except BaseException:
            self.mapper.wait(ahead or self.mapper.submit(mapping))  # the cache keeps the ledger's pages all the same
            raise
        ahead = ahead or self.mapper.submit(mapping)
        pending = self._in_flight = PendingOutput(step.step, launched, ahead)
        return pending

    def hand(self, handed: tuple[torch.Tensor, dict[int, int]] | None) -> None:
        """The first pipeline stage of a token ring, before each step: ``(tokens, rows)``, where
        ``tokens[rows[seq_id]]`` is what the last stage drew for ``seq_id`` in the step whose sequences come round in
        this one, on this device (their placeholders take them); None where that step drew nothing."""
        self._handed = handed

    def _plan(self, step: StepInput, prev: LaunchedStep | None) -> StepPlan:
        """The step's chunks; a placeholder becomes the token drawn for the sequence last: read already, or still on
        the device in ``prev`` (launched here, not finished), or handed back by the last stage (``hand``)."""
        source, on_device = (prev.tokens, prev.rows) if prev is not None and prev.tokens is not None else (
            self._handed if self._handed is not None else (None, {}))
        chunks, fill_chunks, fill_rows = [], [], []
        for i, seq_id in enumerate(step.seq_ids):
            seq = self._seqs[seq_id]
            tokens = step.token_ids[step.offsets[i] : step.offsets[i + 1]]
            if tokens[-1] == PLACEHOLDER:
                if not self.model.is_first:  # a later pipeline stage reads the stage before's rows, not token ids
                    tokens = tokens[:-1] + (0,)
                elif seq_id in on_device:
                    fill_chunks.append(i)
                    fill_rows.append(on_device[seq_id])
                    tokens = tokens[:-1] + (0,)  # written over on the device
                elif seq_id in self._last:
                    tokens = tokens[:-1] + (self._last[seq_id],)
                else:
                    raise ValueError(f"step {step.step}: seq {seq_id} ends in a placeholder, but no token was sampled for it")
            start, prompt = step.starts[i], seq.prompt_token_ids
            targets = (prompt[start + 1 : start + len(tokens) + 1]
                       if seq.params.prompt_logprobs is not None and start + 1 < len(prompt) else ())
            chunks.append(ScheduledChunk(seq_id, step.slots[i], tokens, start, step.num_samples[i],
                                         seq.params, seq.seed, step.output_index[i], seq.sample_index,
                                         step.allowed.get(seq_id), step.banned.get(seq_id, ()), targets,
                                         seq_id in step.late_masks))
        fill = TokenFill(tuple(fill_chunks), source, tuple(fill_rows)) if fill_chunks else None
        return StepPlan(tuple(chunks), fill)

    def report(self) -> WorkerReport:
        """This shard's pool counters (no walk over slots' pages)."""
        maps, unmaps, stall = self.cache.counters()
        latencies = self.cache.recent_map_latency_us(maps - self._reported_maps)
        self._reported_maps = maps
        return WorkerReport(self.config.pp_rank, self.config.tp_rank, self.cache.slots_in_use(), self.cache.mapped_bytes(),
                            self.cache.free_pages(), maps, unmaps, stall, self._busy, self.swap.used_bytes if self.swap else 0,
                            latencies, self._device, self.tp.peer is not None)

    def start_profile(self, directory: str) -> None:
        """Record this worker's steps under torch's profiler (``StepProfiler``) until ``stop_profile``, which writes
        ``directory/vattn_pp{P}_tp{T}.pt.trace.json.gz`` on this worker's host."""
        c = self.config
        self.profiler.start(Path(directory) / f"vattn_pp{c.pp_rank}_tp{c.tp_rank}.pt.trace.json.gz")

    def stop_profile(self) -> str:
        """Stop recording; the trace's path."""
        return str(self.profiler.stop())

    def close(self) -> None:
        """Stop the mapper and give every byte of KV memory back (and the profiler, writing its trace)."""
        if self.profiler.active:  # closed while recording (the engine stopping, or its workers rebuilt): keep the trace
            try:
                logger.warning("worker closed while profiling: its trace is in %s", self.profiler.stop())
            except Exception:
                logger.exception("worker closed while profiling: its trace could not be written")
        if self.cache is None:
            return
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # kernels still queued (a step in flight, or one that failed) read the pages
        finally:
            try:
                self.runner.close()  # its graphs before the TP group they captured collectives of
                self.mapper.close()
            finally:
                self.cache.close()
                self.cache = None
