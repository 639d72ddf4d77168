"""Deterministic mode (``--deterministic``, docs/deterministic.md): do 48 requests get the same tokens in every batch,
and what does the mode cost on W1? One process, one device call.

1. Agreement: 48 requests of W1's prompts, greedy and then seeded (temperature 0.8, a seed each), every token's
   logprob returned; run with a batch cap of 48, of 7 and of 1, with 512-token steps, under a KV pool a quarter of
   what they need (preemption), and with ``--ray`` on the Ray engine. Each run's outputs (tokens and logprobs)
   are compared with the cap-48 run's. The default mode, capped at 48 and at 7, for contrast (issue 25 measured 1
   of 48 alike on the H100).
2. Cost: W1 (128 requests, prompts 512-2048, 128 out) in the default mode and the deterministic one, alternating
   (default, deterministic, deterministic, default) after a warm-up of each. Target: <= 1.15x.

The in-process engines share one set of weights (``llama-3-8b`` in bf16 is 16 GB); the Ray engine's workers make
the same ones from the same seed.

    python bench/deterministic.py [--model llama-3-8b] [--ray] [--name deterministic_h100]
    python bench/deterministic.py --model tiny --device cpu --requests 8 --name deterministic_cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import torch

import report
from cluster.config import EngineConfig, model_config, plan
from cluster.engine import LLM
from throughput import random_prompts, workload_options
from worker.config import PRESETS
from worker.loader import build_model
from worker.sampling import SamplingParams

GiB = 1 << 30
ORDER = ("default", "deterministic", "deterministic", "default")


def outputs(model, prompts, params, **engine) -> tuple[list, dict]:
    """Each request's (token ids, logprobs), and the run's wall and preemptions."""
    with LLM(model, **engine) as llm:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        preemptions = llm.snapshot().num_preemptions
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs], {"wall_s": wall,
                                                                                   "preemptions": preemptions}


def agreement(model, name: str, prompts, args, base: dict) -> tuple[list[list], dict]:
    """Rows of (sampling, run, requests alike / all, wall, preemptions) and the raw stats."""
    n = len(prompts)
    token_bytes = plan(EngineConfig(model=name, device=args.device), model_config(name), args.device).ledger_spec.bytes_per_token
    needed = sum(len(p) + args.agreement_output for p in prompts) * token_bytes
    runs = {
        f"cap {n}": dict(max_num_seqs=n),
        "cap 7": dict(max_num_seqs=7),
        "cap 1": dict(max_num_seqs=1),
        "512-token steps": dict(max_num_seqs=n, max_num_batched_tokens=512),
        "KV pool / 4": dict(max_num_seqs=n, kv_memory=max(needed // 4, 64 << 20)),  # 64 MiB: a few pages of any model
    }
    sampling = {
        "greedy": [SamplingParams(max_tokens=args.agreement_output, temperature=0, ignore_eos=True, logprobs=1)] * n,
        "seeded": [SamplingParams(max_tokens=args.agreement_output, temperature=0.8, seed=1000 + i, ignore_eos=True,
                                  logprobs=1) for i in range(n)],
    }
    rows, raw = [], {}
    for kind, params in sampling.items():
        reference, stats = outputs(model, prompts, params, deterministic=True, **{**base, **runs[f"cap {n}"]})
        rows.append([kind, f"deterministic, cap {n} (reference)", f"{n}/{n}", stats["wall_s"], stats["preemptions"]])
        for run, options in list(runs.items())[1:]:
            got, stats = outputs(model, prompts, params, deterministic=True, **{**base, **options})
            alike = sum(a == b for a, b in zip(got, reference))
            rows.append([kind, f"deterministic, {run}", f"{alike}/{n}", stats["wall_s"], stats["preemptions"]])
            raw[f"{kind} / {run}"] = {"alike": alike, **stats}
            print(rows[-1], flush=True)
        if args.ray:
            got, stats = outputs(name, prompts, params, deterministic=True, distributed="ray", **{**base, **runs["cap 7"]})
            alike = sum(a == b for a, b in zip(got, reference))
            rows.append([kind, "deterministic, Ray, cap 7", f"{alike}/{n}", stats["wall_s"], stats["preemptions"]])
            raw[f"{kind} / ray"] = {"alike": alike, **stats}
        wide, _ = outputs(model, prompts, params, **{**base, **runs[f"cap {n}"]})
        narrow, stats = outputs(model, prompts, params, **{**base, **runs["cap 7"]})
        alike = sum(a == b for a, b in zip(wide, narrow))
        tokens_alike = sum(a[0] == b[0] for a, b in zip(wide, narrow))
        rows.append([kind, f"default, cap 7 against cap {n}", f"{alike}/{n} ({tokens_alike} in tokens)", stats["wall_s"],
                     stats["preemptions"]])
        raw[f"{kind} / default"] = {"alike": alike, "tokens_alike": tokens_alike, **stats}
        print(rows[-1], flush=True)
    return rows, raw


def cost(model, args, base: dict) -> tuple[dict[str, list[float]], dict[str, list[str]]]:
    prompts = random_prompts(PRESETS[args.model], 128, 512, 2048)
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    engine = dict(base, max_num_seqs=128, kv_memory=int(args.kv_memory_gib * GiB))
    walls: dict[str, list[float]] = {"default": [], "deterministic": []}
    compiled: dict[str, list[str]] = {}
    for k, mode in enumerate(ORDER):
        gc.collect()
        with LLM(model, deterministic=mode == "deterministic", **engine) as llm:
            # Warm-up: whole prompts over several steps (prefill chunks, then mixed steps), as W1 runs them
            llm.generate(prompts[:16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            before = triton_kernels()
            start = time.perf_counter()
            llm.generate(prompts, params)
            walls[mode].append(time.perf_counter() - start)
            compiled[f"{k}: {mode}"] = sorted(triton_kernels() - before)
        print(f"W1 {mode}: {walls[mode][-1]:.3f} s; Triton kernels compiled while timed: {compiled[f'{k}: {mode}']}", flush=True)
    return walls, compiled


def triton_kernels() -> set[str]:
    """The compiled kernels in Triton's cache: one compiled inside a timed run would be counted in its wall."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return {f"{p.parent.name[:8]}/{p.stem}" for p in cache.glob("*/*.json") if not p.name.startswith("__")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_options(parser)
    parser.add_argument("--agreement-requests", type=int, default=48)
    parser.add_argument("--agreement-output", type=int, default=128)
    parser.add_argument("--kv-memory-gib", type=float, default=40)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ray", action="store_true", help="also run the agreement on the Ray engine (cap 7)")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--name", default="deterministic")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(args.model, dtype, args.device)
    prompts = random_prompts(PRESETS[args.model], args.agreement_requests, args.min_prompt, args.max_prompt)
    # Prefix caching off: every run sends the same prompts, and hits would make the later runs mostly decode.
    base = dict(device=args.device, max_model_len=args.max_prompt + max(args.output, args.agreement_output),
                max_num_batched_tokens=8192, kv_memory=int(args.kv_memory_gib * GiB), enable_prefix_caching=False)
    rows, raw = ([], {}) if args.skip_agreement else agreement(model, args.model, prompts, args, base)
    walls, compiled = ({}, {}) if args.skip_cost else cost(model, args, base)
    if walls:
        ratio = statistics.mean(walls["deterministic"]) / statistics.mean(walls["default"])
        rows.append(["W1 cost", "deterministic / default wall", f"{ratio:.3f}x", statistics.mean(walls["deterministic"]), 0])
    report.write(args.name, ["sampling", "run", "alike (tokens and logprobs)", "wall s", "preemptions"], rows, {
        "workload": {"model": args.model, "agreement_requests": args.agreement_requests, "prompts": [args.min_prompt,
                     args.max_prompt], "agreement_output": args.agreement_output, "w1_output": args.output},
        "engine": base, "agreement": raw, "order": ORDER, "walls_s": walls, "compiled_while_timed": compiled,
    })


if __name__ == "__main__":
    main()
