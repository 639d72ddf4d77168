"""Why a process's first engine runs W1 slower than its second: host time per worker call, and the slowest calls
torch's profiler records, for two engines built one after the other in one process, each warmed up as
``throughput.py`` does and then timed on W1.

Host time is wall time inside the engine's and worker's calls (wrapped for the timed run only); a call that
should only queue kernels but takes a step's length shows the host waiting for the device. This is how the
cold-cuBLAS-shape stall was found (``first_engine_profile_h100.log``, docs/performance.md, "The first engine in
a process").

    python bench/first_engine.py [--engines 2] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import time
from pathlib import Path

import torch

import report
import cluster.engine_core as engine_core
import kvmem.mapper as mapper
import worker.runner as runner
import worker.worker as worker
from cluster.engine import LLM
from throughput import GiB, random_prompts
from worker.config import PRESETS
from worker.sampling import SamplingParams

#: (module or class, attribute) -> label of the host calls timed
CALLS = {
    (engine_core.EngineCore, "step"): "core.step",
    (engine_core.EngineCore, "_step_input"): "core._step_input",
    (worker.Worker, "launch"): "worker.launch",
    (worker.Worker, "finish"): "worker.finish",
    (worker.Worker, "_plan"): "worker._plan",
    (worker, "apply_ops"): "apply_ops",
    (runner.ModelRunner, "launch"): "runner.launch",
    (mapper.AsyncMapper, "wait"): "mapper.wait",
}


class HostTimes:
    """Wraps ``CALLS`` once; records (label, start, end) while ``on``."""

    def __init__(self):
        self.on = False
        self.calls: list[tuple[str, float, float]] = []
        for (owner, name), label in CALLS.items():
            setattr(owner, name, self._timed(getattr(owner, name), label))

    def _timed(self, fn, label):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    self.calls.append((label, start, time.perf_counter()))
        return timed

    def summary(self) -> dict:
        total, longest, count = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
        for label, start, end in self.calls:
            total[label] += end - start
            longest[label] = max(longest[label], end - start)
            count[label] += 1
        return {label: {"calls": count[label], "total_ms": 1e3 * total[label], "max_ms": 1e3 * longest[label]} for label in total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=512)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--kv-memory-gib", type=float, default=40)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true", help="also the 25 slowest aten::mm calls, with shapes")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    parser.add_argument("--name", default="first_engine")
    args = parser.parse_args()
    prompts = random_prompts(PRESETS[args.model], args.requests, args.min_prompt, args.max_prompt)
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    cuda = args.device == "cuda"
    times = HostTimes()
    results, rows = [], []
    for engine in range(args.engines):
        with LLM(args.model, kv_layout="mega", kv_memory=int(args.kv_memory_gib * GiB), max_num_seqs=args.requests,
                 max_model_len=args.max_prompt + args.output, max_num_batched_tokens=8192, device=args.device,
                 dtype="bfloat16" if cuda else "float32") as llm:
            llm.generate([p[:512] for p in prompts], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            llm.reset_prefix_cache()  # the timed run computes every prompt token
            before = llm.snapshot()
            if cuda:
                torch.cuda.synchronize()
            times.calls.clear()
            times.on = True
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            with profiler if args.profile else contextlib.nullcontext():
                start = time.perf_counter()
                llm.generate(prompts, params)
                wall = time.perf_counter() - start
            times.on = False
            after = llm.snapshot()
        stall = after.workers[0].stall_seconds - before.workers[0].stall_seconds
        result = {"engine": engine, "wall_s": wall, "stall_s": stall, "host": times.summary()}
        if args.profile:
            mms = sorted((e for e in profiler.events() if e.name == "aten::mm"), key=lambda e: -e.time_range.elapsed_us())
            result["slowest_mm"] = [(e.time_range.elapsed_us() / 1e3, e.input_shapes) for e in mms[:25]]
        results.append(result)
        print(f"engine {engine}: wall {wall:.3f} s, stall {stall:.3f} s")
        for label, h in sorted(result["host"].items()):
            print(f"   {label:18s} n={h['calls']:5d} total {h['total_ms']:9.1f} ms  max {h['max_ms']:8.1f} ms")
            rows.append([engine, label, h["calls"], h["total_ms"], h["max_ms"]])
        if args.profile:
            print("   slowest mm:", json.dumps([(round(ms, 1), shapes) for ms, shapes in result["slowest_mm"]]))
        if cuda:
            torch.cuda.empty_cache()
    report.write(args.name, ["engine", "call", "calls", "total ms", "max ms"], rows, {"engines": results}, args.out)


if __name__ == "__main__":
    main()
