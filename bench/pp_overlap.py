"""Pipeline parallelism launching ahead (issue 26): the Ray engine at PP=N with a micro-batch a stage in flight
(the default) against one step at a time (``async_scheduling=False``), on the same requests, alternating (one step
at a time, micro-batches, micro-batches, one step at a time) in one process. In float32 (CPU) both must give the
same greedy tokens; in bf16 (GPU) a step's batch changes its rounding, and random weights leave near-ties that then
flip, so there the share of tokens alike is reported (each run against the first).

    python bench/pp_overlap.py --model llama-3-8b --pp 2 --name pp_overlap_h200x2          # W1 on two GPUs
    python bench/pp_overlap.py --model tiny --device cpu --requests 64 --min-prompt 32 --max-prompt 256 --output 64 \\
        --name pp_overlap_cpu                                                                 # gloo, two CPU workers
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import report
from cluster.engine import LLM
from throughput import random_prompts, workload_options
from worker.config import PRESETS
from worker.sampling import SamplingParams

GiB = 1 << 30
ORDER = ("one step at a time", "micro-batches", "micro-batches", "one step at a time")


def timed(args, prompts, overlap: bool) -> tuple[float, list[list[int]], dict]:
    """One engine's wall on the workload after a warm-up, its tokens, and its step counts."""
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    with LLM(args.model, distributed="ray", pipeline_parallel_size=args.pp, async_scheduling=None if overlap else False,
             device=args.device, dtype=dtype, kv_memory=int(args.kv_memory_gib * GiB), max_num_seqs=len(prompts),
             max_model_len=args.max_prompt + args.output, max_num_batched_tokens=args.max_num_batched_tokens) as llm:
        llm.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        llm.reset_prefix_cache()  # the timed run computes every prompt token
        before = llm.snapshot()
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True))
        wall = time.perf_counter() - start
        after = llm.snapshot()
    steps = {"steps": after.num_steps - before.num_steps,
             "overlapped_steps": after.num_overlapped_steps - before.num_overlapped_steps}
    return wall, [list(o.outputs[0].token_ids) for o in outs], steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_options(parser)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-memory-gib", type=float, default=40)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--name", default="pp_overlap")
    args = parser.parse_args()
    prompts = random_prompts(PRESETS[args.model], args.requests, args.min_prompt, args.max_prompt)
    walls: dict[str, list[float]] = {mode: [] for mode in ORDER}
    steps: dict[str, list[dict]] = {mode: [] for mode in ORDER}
    tokens, alike = None, []
    for mode in ORDER:
        wall, got, counts = timed(args, prompts, mode == "micro-batches")
        if tokens is not None:
            same = sum(a == b for g, t in zip(got, tokens) for a, b in zip(g, t)) / sum(map(len, tokens))
            first = sum(g[0] == t[0] for g, t in zip(got, tokens)) / len(tokens)
            alike.append({"run": mode, "tokens": same, "first_tokens": first})
            print(f"{mode}: {same:.1%} of the tokens and {first:.1%} of the first tokens as in the first run")
            if args.device == "cpu" and got != tokens:
                raise SystemExit(f"{mode}: float32 tokens differ from the first run's")
        tokens = tokens or got
        walls[mode].append(wall)
        steps[mode].append(counts)
        print(f"{mode}: {wall:.3f} s, {counts}", flush=True)
    base = statistics.mean(walls["one step at a time"])
    rows = [[mode, statistics.mean(w), statistics.mean(w) / base, steps[mode][0]["steps"], steps[mode][0]["overlapped_steps"]]
            for mode, w in walls.items()]
    report.write(args.name, [f"PP={args.pp}", "wall s (mean)", "x one step at a time", "steps", "sent while one ran"],
                 rows, {"workload": {"model": args.model, "requests": args.requests, "prompts": [args.min_prompt, args.max_prompt],
                                     "output": args.output},
                        "order": ORDER, "walls_s": walls, "steps": steps, "tokens_alike": alike})


if __name__ == "__main__":
    main()
