"""KV memory and request telemetry the scheduler keeps: the latest pool report of every worker, recent
map latencies, and a snapshot dataclass for exporters (Prometheus, dashboards)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cluster.config import EnginePlan
from kvmem.ledger import PageLedger
from worker.messages import WorkerReport


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
            self.peak_mapped[key] = max(self.peak_mapped[key], r.mapped_bytes)

    def reset(self) -> None:
        """A rebuilt worker group starts from zero."""
        self.reports.clear()
        self._busy = 0.0
        for samples in self.latency.values():
            samples.clear()

    def workers(self, ledger: PageLedger) -> tuple[WorkerMemory, ...]:
        used_tokens_bytes = ledger.stats().used_bytes  # in the ledger spec's bytes
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
            ))
        return tuple(out)
