"""Where the device waits between steps: one of ``peer.py``'s workloads through the in-process engine, every step's
host and device times on one clock, and each idle gap put down to what the host was doing while it lasted.

    python bench/step_timeline.py --workload memory [--reps 2] [--out results/step_timeline_memory_h100.json]

With async scheduling the host prepares step k+1 while step k runs, so the device idles only where the host was
late: still in the engine (scheduling, reading step k-1's tokens), applying the step's KV operations (mapping
pages, waiting for a fence before unmapping a freed slot's), or queueing its kernels. A gap is split over those
spans of the host's timeline; what is left is the device starting the queued work. Device times come from each
step's own CUDA events (``LaunchedStep.begun`` / ``queued``), placed on the host's clock by an event recorded on
the idle device at the start of the run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import report
from peer import GiB, WORKLOADS, vattn_stepwise
import kvmem
from cluster.engine import LLM
from kvmem.cache import VirtualKVCache
from worker import worker as worker_module
from worker.config import PRESETS
from worker.sampling import SamplingParams

SPANS = ("engine", "kv_ops_fence", "kv_ops_map", "launch", "device_start")


@dataclass
class StepTimes:
    step: int
    seqs: int
    prefill_tokens: int
    launch_start: float  # host seconds since the run's start
    ops_start: float
    ops_end: float
    launch_end: float
    fence_wait: float  # of the KV operations' time, waiting for queued work before an unmap
    maps: int
    unmaps: int
    device_start: float | None = None  # device seconds since the same start (CUDA)
    device_end: float | None = None


class Recorder:
    """Wraps one in-process worker's ``launch`` and its KV operations, recording a ``StepTimes`` a step."""

    def __init__(self, llm: LLM):
        self.worker = llm.core.executor.worker
        self.steps: list[StepTimes] = []
        self._launched = []
        self._apply_ops = worker_module.apply_ops
        self._launch = self.worker.launch
        self._ops: tuple[float, float] = (0.0, 0.0)
        self.base_host = 0.0
        self.base_event = None

    def __enter__(self) -> "Recorder":
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            self.base_event = torch.cuda.Event(enable_timing=True)
            self.base_event.record()
            self.base_event.synchronize()  # the device is idle: the event's time is the host's now
        self.base_host = time.perf_counter()
        worker_module.apply_ops = self._timed_ops
        self.worker.launch = self._timed_launch
        return self

    def __exit__(self, *exc) -> None:
        worker_module.apply_ops = self._apply_ops
        del self.worker.launch  # the class's method again
        if self.base_event is not None:
            torch.cuda.synchronize()
            for times, launched in zip(self.steps, self._launched):
                if launched is not None and launched.begun is not None:
                    times.device_start = self.base_event.elapsed_time(launched.begun) / 1e3
                    times.device_end = self.base_event.elapsed_time(launched.queued) / 1e3

    def _timed_ops(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._apply_ops(*args, **kwargs)
        finally:
            self._ops = (start, time.perf_counter())

    def _timed_launch(self, step, inputs=None):
        cache = self.worker.cache
        (maps, unmaps, _), fenced = cache.counters(), cache.fence_wait_seconds()
        self._ops = (0.0, 0.0)
        start = time.perf_counter()
        pending = self._launch(step, inputs)
        end = time.perf_counter()
        (maps2, unmaps2, _), fenced2 = cache.counters(), cache.fence_wait_seconds()
        ops_start, ops_end = self._ops if self._ops[0] else (start, start)
        prefill = sum(b - a for a, b in zip(step.offsets, step.offsets[1:]) if b - a > 1)
        b = self.base_host
        self.steps.append(StepTimes(step.step, len(step.seq_ids), prefill, start - b, ops_start - b, ops_end - b, end - b,
                                    fenced2 - fenced, maps2 - maps, unmaps2 - unmaps))
        self._launched.append(pending.launched)
        return pending


def attribute(steps: list[StepTimes]) -> dict:
    """Each idle gap between one step's device end and the next one's device start, split over what the host was
    doing meanwhile (``SPANS``), summed by kind of next step (prefill or decode)."""
    timed = [s for s in steps if s.device_start is not None]
    out = {kind: dict.fromkeys(SPANS, 0.0) | {"gaps": 0, "idle_s": 0.0} for kind in ("prefill", "decode")}
    for prev, nxt in zip(timed, timed[1:]):
        lo, hi = prev.device_end, nxt.device_start
        if hi <= lo:
            continue
        kind = out["prefill" if nxt.prefill_tokens else "decode"]
        kind["gaps"] += 1
        kind["idle_s"] += hi - lo
        # The fence waits are put first among the KV operations: where exactly they fell inside is not recorded.
        fence_end = nxt.ops_start + nxt.fence_wait
        spans = (("engine", lo, nxt.launch_start), ("launch", nxt.launch_start, nxt.ops_start),
                 ("kv_ops_fence", nxt.ops_start, fence_end), ("kv_ops_map", fence_end, nxt.ops_end),
                 ("launch", nxt.ops_end, nxt.launch_end), ("device_start", nxt.launch_end, hi))
        for name, a, b in spans:
            kind[name] += max(0.0, min(hi, b) - max(lo, a))
    return out


def run(args) -> dict:
    w = WORKLOADS[args.workload]
    config = PRESETS[args.model or w.model]
    prompts, _ = w.prompts(config, args.seed)
    prompts = [p[: config.max_context - w.output] for p in prompts]  # a small model's shorter context
    kv = int((args.kv_memory_gib or w.kv_memory_gib or 40) * GiB)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine_args = dict(max_num_seqs=w.requests, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=min(w.max_len, config.max_context), kv_memory=kv, device=device,
                       dtype="bfloat16" if device == "cuda" else "float32", load_format="dummy")
    rounds = []
    with LLM(args.model or w.model, **engine_args) as llm:
        llm.generate([p[:64] for p in prompts[:8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        for round_ in range(args.reps):
            before = llm.snapshot()
            with Recorder(llm) as rec:
                wall, _, _ = vattn_stepwise(llm, prompts, w.output)  # from an empty prefix cache, as peer.py times it
            after = llm.snapshot()
            gaps = attribute(rec.steps)
            busy = sum(s.device_end - s.device_start for s in rec.steps if s.device_start is not None)
            rounds.append({"wall_s": wall, "device_busy_s": busy, "steps": len(rec.steps),
                           "stall_s": after.workers[0].stall_seconds - before.workers[0].stall_seconds,
                           "preemptions": after.num_preemptions - before.num_preemptions, "gaps": gaps,
                           "maps": sum(s.maps for s in rec.steps), "unmaps": sum(s.unmaps for s in rec.steps),
                           "fence_wait_s": sum(s.fence_wait for s in rec.steps),
                           "timeline": [asdict(s) for s in rec.steps] if args.timeline else None})
            r = rounds[-1]
            print(f"round {round_}: wall {r['wall_s']:.3f} s, device busy {r['device_busy_s']:.3f} s, {r['steps']} "
                  f"steps, stall {r['stall_s']:.3f} s, {r['preemptions']} preemptions, {r['maps']} maps, "
                  f"{r['unmaps']} unmaps, fence waits {r['fence_wait_s']:.3f} s", flush=True)
        attention = llm.core.plan.attention
    return {"workload": args.workload, "about": w.about, "engine_args": engine_args | {"attention": attention},
            "kvmem": str(Path(kvmem.__file__).parent), "deferred_unmaps": getattr(VirtualKVCache, "defers_unmaps", False),
            "rounds": rounds}


HEADERS = ["round", "next step", "gaps", "idle s", *(f"{name} s" for name in SPANS)]


def rows(rounds: list[dict]) -> list[list]:
    return [[i, kind, g["gaps"], g["idle_s"], *(g[name] for name in SPANS)]
            for i, r in enumerate(rounds) for kind, g in r["gaps"].items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="memory", choices=sorted(WORKLOADS))
    parser.add_argument("--model", help="a preset instead of the workload's (a small one to try it on CPU)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-memory-gib", type=float, help="KV bytes instead of the workload's (default: its own, or 40)")
    parser.add_argument("--timeline", action="store_true", help="keep every step's times in the JSON")
    parser.add_argument("--no-deferred-unmaps", action="store_true",
                        help="take a fenced slot's pages only after the step that reads them (as before 2026-11-27)")
    parser.add_argument("--name", help="results name (default: step_timeline_<workload>)")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    args = parser.parse_args()
    if args.no_deferred_unmaps:
        VirtualKVCache.defers_unmaps = False
    result = run(args)
    report.write(args.name or f"step_timeline_{args.workload}", HEADERS, rows(result["rounds"]), result, args.out)


if __name__ == "__main__":
    main()
