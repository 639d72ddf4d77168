"""Where a step's time goes on the GPU: wall time per step against the GPU's kernel time in it (torch.profiler,
CUPTI) and against its floor, for W1's prefill steps and its full-batch decode steps.

The gap between wall and kernel time is host work the GPU waits for (scheduling, inputs, sampling, the sync that
returns the tokens); the gap between kernel time and the floor is the kernels' own inefficiency (launches, small
ops, attention). Floors as in ``throughput.py``: prefill FLOPs over the measured matmul rate; decode weights + KV
bytes over the measured copy bandwidth. In-process engine (the profiler sees this process's kernels only).

    python bench/step_profile.py [--layout mega] [--attention fa2] [--deterministic] [--steps 24]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import report
from cluster.engine import LLM
from throughput import GiB, ceilings, model_sizes, random_prompts
from trace_breakdown import category
from worker.config import PRESETS
from worker.sampling import SamplingParams


def kernel_seconds(prof) -> tuple[float, list[tuple[str, float, int]]]:
    """The union of the GPU kernels' intervals (seconds) and the top kernels by total time (name, s, calls)."""
    spans, totals = [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            spans.append((e.time_range.start, e.time_range.end))
            name, (t, n) = e.name, totals.get(e.name, (0.0, 0))
            totals[name] = (t + e.device_time_total / 1e6, n + 1)
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            busy += e - max(s, end)
            end = e
    top = sorted(((n, t, c) for n, (t, c) in totals.items()), key=lambda x: -x[1])[:12]
    return busy / 1e6, top


def kernel_kinds(prof) -> dict[str, float]:
    """Seconds of GPU kernel time by kind (``trace_breakdown.category``), overlapping kernels each counted in full."""
    kinds: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            kind = category(e.name)
            kinds[kind] = kinds.get(kind, 0.0) + e.device_time_total / 1e6
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def timed_steps(llm: LLM, count: int, every: bool) -> list[tuple[float, int, int, int]]:
    """``count`` steps, each synchronised: (wall s, sequences, tokens, prefill tokens) of each. ``every``: every
    request's output is built each step (as streaming does), else only the finished ones' (as ``generate``)."""
    out = []
    for _ in range(count):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.step(finished_only=not every)
        torch.cuda.synchronize()
        info = llm.last_step
        out.append((time.perf_counter() - start, info.num_seqs, info.num_tokens, info.num_prefill_tokens))
    return out


def profiled_steps(llm: LLM, count: int, every: bool) -> dict:
    """``count`` steps timed bare, then ``count`` more under the profiler (which slows the host a little):
    the bare wall time, and the kernel time of the profiled ones."""
    bare = timed_steps(llm, count, every)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        profiled = timed_steps(llm, count, every)
    busy, top = kernel_seconds(prof)
    steps = bare + profiled
    return {"steps": count, "wall_s": sum(s[0] for s in bare), "profiled_wall_s": sum(s[0] for s in profiled),
            "kernel_s": busy, "seqs": [s[1] for s in steps], "tokens": [s[2] for s in steps],
            "prefill_tokens": [s[3] for s in steps], "top_kernels": top, "kernel_kinds_s": kernel_kinds(prof)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--layout", default="mega")
    parser.add_argument("--attention")
    parser.add_argument("--deterministic", action="store_true", help="the batch-invariant mode (docs/deterministic.md)")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24, help="decode steps profiled")
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--host-profile", action="store_true", help="also cProfile the host side of decode steps")
    parser.add_argument("--outputs-every-step", action="store_true",
                        help="build every request's output each step, as streaming does (default: as generate does)")
    parser.add_argument("--name", default="step_profile")
    args = parser.parse_args()
    config = PRESETS[args.model]
    prompts = random_prompts(config, args.requests, 512, 2048)  # W1's
    ceil = ceilings()
    params, weight_bytes, kv_token = model_sizes(config)
    with LLM(args.model, kv_layout=args.layout, attention=args.attention, deterministic=args.deterministic, kv_memory=40 * GiB, device="cuda",
             dtype="bfloat16", max_num_seqs=args.requests, max_model_len=2048 + args.output,
             max_num_batched_tokens=args.max_num_batched_tokens,
             # each step is timed on its own: launched ahead, a step's tokens come back with the next step
             async_scheduling=False) as llm:
        llm.generate([p[:512] for p in prompts], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        llm.reset_prefix_cache()  # the profiled steps compute every prompt token
        for p in prompts:
            llm.add_request(p, SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True))
        prefill = profiled_steps(llm, 3, args.outputs_every_step)  # chunked prefill: 8192-token steps (W1 has ~20 of them)
        assert all(prefill["prefill_tokens"]), "the prefill ended before the profile did"
        while llm.last_step.num_prefill_tokens or llm.last_step.num_seqs < args.requests:
            llm.step()  # the rest of the prefill: then every request decodes at once
        timed_steps(llm, 4, args.outputs_every_step)  # settle
        decode = profiled_steps(llm, args.steps, args.outputs_every_step)
        if args.host_profile:  # where the host's part of a decode step goes (cProfile; slows the host ~2x)
            host = cProfile.Profile()
            host.runcall(timed_steps, llm, args.steps, args.outputs_every_step)
            pstats.Stats(host).sort_stats("tottime").print_stats(30)
        assert not any(decode["prefill_tokens"]) and set(decode["seqs"]) == {args.requests}
        context = sum(map(len, prompts)) + args.requests * (args.output // 2)  # mid-decode, roughly
        while llm.scheduler.has_work:
            llm.step()
    n = prefill["steps"]
    prefill_flops = sum(2 * t * params for t in prefill["tokens"][:n])  # attention FLOPs left out: a lower floor
    decode_floor = (weight_bytes + kv_token * context) / ceil["copy_bytes_per_s"]
    rows = [
        ["prefill", n, 1e3 * prefill["wall_s"] / n, 1e3 * prefill["kernel_s"] / n, 1e3 * prefill_flops / n / ceil["matmul_flops"]],
        ["decode", decode["steps"], 1e3 * decode["wall_s"] / decode["steps"], 1e3 * decode["kernel_s"] / decode["steps"],
         1e3 * decode_floor],
    ]
    for row in rows:
        row += [row[2] / row[4], row[3] / row[4], 1 - row[3] / row[2]]
    headers = ["steps", "n", "wall ms", "GPU kernel ms", "floor ms", "wall x floor", "kernels x floor", "GPU idle"]
    for label, r in (("prefill", prefill), ("decode", decode)):
        print(f"\n{label}: top kernels (s over the profiled steps, calls)")
        for name, t, c in r["top_kernels"]:
            print(f"  {t * 1e3:9.2f} ms {c:6d}  {name[:110]}")
    data = {"model": args.model, "layout": args.layout, "attention": args.attention, "deterministic": args.deterministic,
            "requests": args.requests,
            "async_scheduling": False, "outputs_every_step": args.outputs_every_step,
            "ceilings": ceil, "prefill": prefill, "decode": decode,
            "decode_context_tokens": context, "weight_bytes": weight_bytes}
    report.write(args.name, headers, rows, data, Path(report.RESULTS))


if __name__ == "__main__":
    main()
