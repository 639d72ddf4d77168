"""KV memory and request telemetry the scheduler keeps: the latest pool report of every worker, map
latencies, request and token counters, latency histograms, and a snapshot dataclass for exporters
(Prometheus, dashboards). Counters and histograms only grow, across worker rebuilds too."""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from cluster.config import EnginePlan
from kvmem.ledger import PageLedger
from worker.messages import WorkerReport


@dataclass
class Histogram:
    """Observations counted into buckets by upper bound (Prometheus's ``le``; one more bucket for +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> "Histogram":
        return Histogram(self.bounds, list(self.counts), self.total)


# vLLM v1's buckets, so that its dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                   960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
POLL_BUCKETS = (1, 2, 3, 4, 6, 8, 16, 32)  # engine outputs of one stream a poll takes at once
MAP_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)  # seconds per page mapped


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's KV memory. Bytes over all its buffers; ``used_bytes`` from the scheduler's ledger
    (valid tokens x this worker's bytes per token), the rest as the worker last reported."""

    pp_rank: int
    tp_rank: int
    reserved_bytes: int  # virtual address space (paged: the block pool)
    pool_bytes: int  # physical pages that exist
    mapped_bytes: int
    peak_mapped_bytes: int
    used_bytes: int
    free_pages: int
    total_pages: int
    slots_in_use: int
    maps: int
    unmaps: int
    stall_seconds: float
    busy_seconds: float  # time the worker spent executing steps
    swap_bytes: int
    map_latency_us: tuple[float, ...]  # recent samples
    map_latency: Histogram  # every sample, in seconds
    prefix_cache_pages: int = 0  # pages (per buffer) the prefix cache holds (some also mapped in running slots)
    prefix_cache_bytes: int = 0  # their physical bytes over all buffers
    device_seconds: float = 0.0  # the device time of the worker's steps (CUDA): wall time less this is device idle
    peer_all_reduce: bool = False  # its TP sums go through peer memory (small ones), else through NCCL

    @property
    def fragmentation(self) -> float:
        """1 - used/mapped."""
        return 1.0 - self.used_bytes / self.mapped_bytes if self.mapped_bytes else 0.0


@dataclass(frozen=True)
class RequestProgress:
    request_id: str
    status: str  # waiting / running / swapped (the furthest along of its sequences)
    prompt_tokens: int
    output_tokens: int  # over all its sequences
    max_tokens: int
    num_preemptions: int


@dataclass(frozen=True)
class EngineSnapshot:
    """What the scheduler knows now."""

    workers: tuple[WorkerMemory, ...]
    requests: tuple[RequestProgress, ...]
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_steps: int
    num_rebuilds: int
    step_seconds: float  # summed over all steps, scheduling and the workers' round trip included
    num_decode_steps: int  # steps without prefill tokens
    decode_step_seconds: float
    decode_busy_seconds: float  # of that, time the first worker spent executing
    kv_usage: float = 0.0  # pages the scheduler's ledger holds for requests / all (the tightest worker)
    prompt_tokens: int = 0  # counted when a request's first token is sampled
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # requests ended, by finish reason
    histograms: dict[str, Histogram] = field(default_factory=dict)  # by vLLM's metric name, without its prefix
    prefix_cache_queries: int = 0  # prompt tokens of sequences admitted to compute from their start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_overlapped_steps: int = 0  # steps submitted while an earlier one was still in flight
    kv_capacity_tokens: int = 0  # tokens the KV pool holds, every page in use (one slot's worth of pages each)
    prefix_runs_fused: int = 0  # cached prefixes made one allocation on their first reuse (``fused_prefix_pages``)


class Telemetry:
    """Latest ``WorkerReport`` per worker plus a window of map latency samples each."""

    def __init__(self, plan: EnginePlan, window: int = 4096):
        self.plan = plan
        self.reports: dict[tuple[int, int], WorkerReport] = {}
        self.latency = {(w.pp_rank, w.tp_rank): deque(maxlen=window) for w in plan.workers}
        self.peak_mapped = {(w.pp_rank, w.tp_rank): 0 for w in plan.workers}
        self.step_seconds = 0.0
        self.num_decode_steps = 0
        self.decode_step_seconds = 0.0
        self.decode_busy_seconds = 0.0  # of that, the first worker's execution
        self._busy = 0.0
        self.map_latency = {(w.pp_rank, w.tp_rank): Histogram(MAP_BUCKETS) for w in plan.workers}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.histograms = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(REQUEST_BUCKETS),
            "request_queue_time_seconds": Histogram(REQUEST_BUCKETS),
            "iteration_tokens_total": Histogram(ITERATION_BUCKETS),
        }
        self._last_token: dict[int, float] = {}  # seq_id -> when its last token came

    def record_tokens(self, seqs, num_tokens: int) -> None:
        """A step's sampled tokens (the sequences that got one) and its size in tokens."""
        now = time.monotonic()
        h = self.histograms
        h["iteration_tokens_total"].observe(num_tokens)
        self.generation_tokens += len(seqs)
        for seq in seqs:
            last = self._last_token.get(seq.seq_id)
            if last is not None:
                h["inter_token_latency_seconds"].observe(now - last)
            self._last_token[seq.seq_id] = now
            times = seq.request.times
            if seq.sample_index == 0 and seq.num_output_tokens == 1:  # the request's first token
                self.prompt_tokens += len(seq.request.prompt_token_ids)
                h["time_to_first_token_seconds"].observe(now - times.arrival)
                h["request_queue_time_seconds"].observe((times.scheduled or now) - times.arrival)

    def record_finished(self, request, reason: str) -> None:
        self.finished[reason] += 1
        self.histograms["e2e_request_latency_seconds"].observe(time.monotonic() - request.times.arrival)
        for seq in request.seqs:
            self._last_token.pop(seq.seq_id, None)

    def record_step(self, prefill_tokens: int, seconds: float) -> None:
        """After ``record`` of the step's reports: its wall time, split out for decode-only steps."""
        self.step_seconds += seconds
        first = self.reports.get((0, 0))
        busy = first.busy_seconds if first else 0.0
        if prefill_tokens == 0:
            self.num_decode_steps += 1
            self.decode_step_seconds += seconds
            self.decode_busy_seconds += max(0.0, busy - self._busy)
        self._busy = busy

    def record(self, reports: tuple[WorkerReport, ...]) -> None:
        for r in reports:
            key = (r.pp_rank, r.tp_rank)
            self.reports[key] = r
            self.latency[key].extend(r.map_latency_us)
            for us in r.map_latency_us:
                self.map_latency[key].observe(us * 1e-6)
            self.peak_mapped[key] = max(self.peak_mapped[key], r.mapped_bytes)

    def reset(self) -> None:
        """A rebuilt worker group starts from zero."""
        self.reports.clear()
        self._busy = 0.0
        for samples in self.latency.values():
            samples.clear()

    def workers(self, ledger: PageLedger) -> tuple[WorkerMemory, ...]:
        used_tokens_bytes = ledger.stats().used_bytes  # in the ledger spec's bytes
        cached = ledger.kept_pages()
        out = []
        for w in self.plan.workers:
            key = (w.pp_rank, w.tp_rank)
            r = self.reports.get(key)
            used = used_tokens_bytes * w.kv_spec.bytes_per_token // self.plan.ledger_spec.bytes_per_token
            reserved = w.pool_bytes if w.kv_spec.layout == "paged" else w.kv_spec.reserved_bytes
            out.append(WorkerMemory(
                w.pp_rank, w.tp_rank, reserved, w.pool_bytes,
                r.mapped_bytes if r else 0, self.peak_mapped[key], used, r.free_pages if r else self.plan.num_pages, self.plan.num_pages,
                r.slots_in_use if r else 0, r.maps if r else 0, r.unmaps if r else 0, r.stall_seconds if r else 0.0,
                r.busy_seconds if r else 0.0, r.swap_bytes if r else 0, tuple(self.latency[key]),
                self.map_latency[key].copy(), cached, cached * w.kv_spec.page_bytes * w.kv_spec.num_buffers,
                r.device_seconds if r else 0.0, r.peer_all_reduce if r else False,
            ))
        return tuple(out)
