"""Where a step's GPU time goes, from a torch.profiler Chrome trace: kernels by category, per engine step.

Both engines' traces are read the same way. A step is a CPU annotation (vLLM's worker writes
``execute_context_C(T)_generation_G(T)`` around each step when its torch profiler is on; ``bench/peer.py``
writes ``vattn_step_...`` around ours); a kernel belongs to the step whose annotation holds the host call that
launched it (the CUDA runtime event with the kernel's correlation id: a kernel launch, or a graph launch for
every kernel of a CUDA-graph replay) and lasts until the next step's annotation: vLLM samples outside its
annotation, after it. The last step, which has no end, is left out. Per step: its host span, the union of its kernels' intervals, and each
category's kernel time.

    python bench/trace_breakdown.py TRACE.json[.gz] [--match REGEX]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

# First match wins: attention kernels' names carry "cutlass" and "gemm"-like words, so they come before matmul;
# vLLM's KV write is named "..._flash_kernel", so it comes before attention. Inductor names a fused RMSNorm by its
# ops (mean, pow, rsqrt).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-reduce", ("nccl", "allreduce", "all_reduce")),  # TP's sums (NCCL's, torch's symmetric-memory kernels)
    ("kv write", ("reshape_and_cache", "store_kv", "concat_and_cache")),
    ("attention", ("flash", "fmha", "attention", "attn", "prefillwithkvcache", "batchdecode", "mergestate")),
    ("norm", ("rms", "norm", "rsqrt")),
    ("activation", ("silu", "act_and_mul", "gelu", "swiglu")),
    ("rope", ("rotary", "rope")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "splitkreduce", "cublas", "wgmma", "matmul", "_mm_")),
    ("sampling", ("argmax", "softmax", "topk", "top_k", "sampl", "gumbel", "exponential", "sort", "max_", "reduce")),
    ("copy / index", ("copy", "index", "gather", "scatter", "memcpy", "memset", "fill", "cat", "elementwise")),
)

# What torch.compile's fused kernels can be, by the ops their names list: the categories before "matmul".
FUSABLE = CATEGORIES[: [name for name, _ in CATEGORIES].index("matmul")]


def category(kernel: str) -> str:
    """The category of a kernel by its name (``other`` when none matches)."""
    low = kernel.lower()
    if low.startswith("triton_") and "fused" in low:  # torch.compile's fusions name what they fuse
        for name, words in FUSABLE:
            if any(w in low for w in words):
                return name
        return "fused elementwise"
    for name, words in CATEGORIES:
        if any(w in low for w in words):
            return name
    return "other"


@dataclass
class Step:
    """One engine step: its annotation, host span and GPU kernel time by category (microseconds)."""

    name: str
    start_us: float
    host_us: float
    kernel_us: float = 0.0  # union of the kernels' intervals
    first_kernel_us: float | None = None
    last_kernel_end_us: float | None = None
    by_category: dict[str, float] = field(default_factory=dict)
    by_kernel: dict[str, float] = field(default_factory=dict)
    launches: int = 0
    # host time within the step's range that the KV mapper spent mapping beside it (its own thread) and that the
    # step's thread waited for mapping (kvmem/mapper.py's ranges; vLLM's traces have none)
    map_ahead_us: float = 0.0
    map_wait_us: float = 0.0
    # the launch's own parts on the host (``vattn_phase_<name>`` ranges inside the step's range: Worker._launch)
    phases_us: dict[str, float] = field(default_factory=dict)


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def steps(events: list[dict], match: str) -> list[Step]:
    """The steps whose annotation matches ``match``, in time order, with their kernels attributed."""
    pattern = re.compile(match)
    marks = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op")
                    and pattern.search(e.get("name", ""))), key=lambda e: e["ts"])
    found = [Step(e["name"], float(e["ts"]), float(e["dur"])) for e in marks]
    starts = [s.start_us for s in found]
    launch_ts = {e["args"]["correlation"]: (float(e["ts"]), e.get("name", "")) for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") != "kernel" or e.get("ph") != "X":
            continue
        launched = launch_ts.get(e.get("args", {}).get("correlation"))
        if launched is None:
            continue
        i = bisect.bisect_right(starts, launched[0]) - 1
        if i < 0:
            continue
        step, ts, dur = found[i], float(e["ts"]), float(e["dur"])
        cat = category(e["name"])
        step.by_category[cat] = step.by_category.get(cat, 0.0) + dur
        step.by_kernel[e["name"]] = step.by_kernel.get(e["name"], 0.0) + dur
        spans.setdefault(i, []).append((ts, ts + dur))
    for e in events:
        if e.get("cat") != "user_annotation":  # not the profiler's copy of a range on the GPU's timeline
            continue
        if e.get("ph") == "X" and e.get("name", "").startswith("vattn_phase_"):
            i = bisect.bisect_right(starts, float(e["ts"])) - 1
            if i >= 0 and float(e["ts"]) <= found[i].start_us + found[i].host_us:
                name = e["name"].removeprefix("vattn_phase_")
                found[i].phases_us[name] = found[i].phases_us.get(name, 0.0) + float(e["dur"])
        if e.get("ph") == "X" and e.get("name") in ("kvmem_map_ahead", "kvmem_map_wait"):
            a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            for step in found[max(bisect.bisect_right(starts, a) - 1, 0):bisect.bisect_right(starts, b)]:
                overlap = min(b, step.start_us + step.host_us) - max(a, step.start_us)
                if overlap > 0 and e["name"] == "kvmem_map_ahead":
                    step.map_ahead_us += overlap
                elif overlap > 0:
                    step.map_wait_us += overlap
    for i, intervals in spans.items():
        found[i].kernel_us = union(intervals)
        found[i].first_kernel_us = min(s for s, _ in intervals)
        found[i].last_kernel_end_us = max(e for _, e in intervals)
        found[i].launches = len(intervals)
    return found[:-1]


def union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def summarize(selected: list[Step], top: int = 8) -> dict:
    """Mean per step (ms) of the kernel union and of each category, the GPU span from the first kernel of a
    step to the first of the next (the step's share of the device timeline, idle time included), and the top
    kernels."""
    n = len(selected)
    if not n:
        return {"steps": 0}
    cats: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for s in selected:
        for k, v in s.by_category.items():
            cats[k] = cats.get(k, 0.0) + v
        for k, v in s.by_kernel.items():
            kernels[k] = kernels.get(k, 0.0) + v
    firsts = [s.first_kernel_us for s in selected if s.first_kernel_us is not None]
    gaps = [b - a for a, b in zip(firsts, firsts[1:])]
    return {
        "steps": n,
        "kernel_ms": sum(s.kernel_us for s in selected) / n / 1e3,
        "host_ms": sum(s.host_us for s in selected) / n / 1e3,
        "device_span_ms": sum(gaps) / len(gaps) / 1e3 if gaps else None,
        "launches": sum(s.launches for s in selected) / n,
        "map_ahead_ms": sum(s.map_ahead_us for s in selected) / n / 1e3,
        "map_wait_ms": sum(s.map_wait_us for s in selected) / n / 1e3,
        "phases_ms": {k: sum(s.phases_us.get(k, 0.0) for s in selected) / n / 1e3
                      for k in dict.fromkeys(k for s in selected for k in s.phases_us)},
        "by_category_ms": {k: v / n / 1e3 for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": [(k[:160], v / n / 1e3) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]],
    }


# A step that computes no prompt token: ours name it ``..._prefill(0)...``, vLLM's ``execute_context_0(0)_...``.
DECODE_ONLY = re.compile(r"prefill\(0\)|^execute_context_0\(0\)")


def quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    values = sorted(values)
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))]
    return {"n": len(values), "mean": statistics.mean(values), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "max": values[-1]}


def timeline(steps: list[Step]) -> dict:
    """A serving engine's steps, as the device ran them: per kind (decode only / prefilling) the host span, the kernel
    union and the device span to the next step's first kernel (ms); and the device's idle time between one step's last
    kernel and the next's first. Both engines' traces read the same way (``DECODE_ONLY``)."""
    timed = [s for s in steps if s.first_kernel_us is not None]
    spans = {id(a): (b.first_kernel_us - a.first_kernel_us) / 1e3 for a, b in zip(timed, timed[1:])}
    idle = [max(0.0, (b.first_kernel_us - a.last_kernel_end_us) / 1e3) for a, b in zip(timed, timed[1:])]
    out = {"steps": len(steps), "device_idle_between_steps_ms": quantiles(idle),
           "device_idle_share": sum(idle) / sum(spans.values()) if spans else None}
    for kind, chosen in (("decode", [s for s in timed if DECODE_ONLY.search(s.name)]),
                         ("prefilling", [s for s in timed if not DECODE_ONLY.search(s.name)])):
        out[kind] = {"host_ms": quantiles([s.host_us / 1e3 for s in chosen]),
                     "kernel_ms": quantiles([s.kernel_us / 1e3 for s in chosen]),
                     "device_span_ms": quantiles([spans[id(s)] for s in chosen if id(s) in spans]),
                     "map_wait_ms": quantiles([s.map_wait_us / 1e3 for s in chosen]),
                     "summary": summarize(chosen, top=6)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--match", default=r"^(execute_context_|vattn_step_)")
    args = parser.parse_args()
    for s in steps(load(args.trace), args.match):
        cats = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(s.by_category.items(), key=lambda kv: -kv[1]))
        print(f"{s.name[:60]:60s} host {s.host_us / 1e3:7.2f} ms  kernels {s.kernel_us / 1e3:7.2f} ms  [{cats}]")


if __name__ == "__main__":
    main()
