"""Hiding allocation latency, the vAttention paper's experiment: physical pages mapped in the step that needs them
against mapped ahead on the mapper thread while the step before computes; deferred reclamation on and off; page
sizes. Side by side in one process, the Llama-3-8B shape with random weights.

Workload (fixed seed): ``--requests`` prompts of random token ids, lengths uniform in [4K, 8K], ``--output`` tokens
each (greedy, EOS ignored), at most ``--batch`` running at once, so that later requests take the slots earlier
ones freed (what deferred reclamation saves). The warm-up runs 16-token prompts only, so that the measured run
maps nearly all of its pages itself.

Each run reports wall time, decode throughput, the mean decode step, and the mapping stall: the seconds steps
waited for pages (mapped in the step, or the mapper not done), as a share of the engine's step time.

    python bench/alloc_latency.py [--runs ahead instep ahead/sync instep/sync eager_reclaim page4m page8m]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import report  # noqa: E402
from throughput import GiB, random_prompts, run_engine  # noqa: E402
from worker.config import PRESETS  # noqa: E402

MiB = 1 << 20
#: run name -> (scheduling suffix for throughput.run_engine, engine options)
RUNS = {
    "ahead": ("", {}),
    "instep": ("", {"map_ahead": False}),
    "ahead/sync": ("/sync", {}),
    "instep/sync": ("/sync", {"map_ahead": False}),
    "eager_reclaim": ("", {"deferred_reclamation": False}),
    "page4m": ("", {"page_size": 4 * MiB}),
    "page8m": ("", {"page_size": 8 * MiB}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help=f"of {list(RUNS)}, each optionally #k (a repeat)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=4096)
    parser.add_argument("--max-prompt", type=int, default=8192)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--kv-memory-gib", type=float, default=40)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--name", default="alloc_latency")
    args = parser.parse_args()
    config = PRESETS[args.model]
    prompts = random_prompts(config, args.requests, args.min_prompt, args.max_prompt)
    results = {}
    for run in args.runs:
        suffix, options = RUNS[run.partition("#")[0]]
        results[run] = run_engine(args.model, "mega" + suffix, prompts, args.output, int(args.kv_memory_gib * GiB),
                                  args.max_num_batched_tokens, warmup_tokens=16, max_num_seqs=args.batch, **options)
        r = results[run]
        print(f"{run}: {r['wall_s']:.2f} s, decode step {r['mean_decode_step_ms']:.2f} ms, stall {r['stall_s']:.3f} s "
              f"({100 * r['stall_s'] / r['engine_step_s']:.2f}% of steps), maps {r['maps']}, unmaps {r['unmaps']}", flush=True)
    output_tokens = args.requests * args.output
    rows = [[run, r["wall_s"], output_tokens / r["wall_s"], r["mean_decode_step_ms"], r["stall_s"],
             100 * r["stall_s"] / r["engine_step_s"], r["maps"], r["unmaps"], r["map_latency_p50_us"], r["peak_kv_bytes"] / GiB]
            for run, r in results.items()]
    headers = ["run", "wall s", "output tok/s", "decode step ms", "stall s", "stall % of steps", "maps", "unmaps",
               "map p50 µs", "peak KV GiB"]
    workload = {"requests": args.requests, "batch": args.batch, "prompt_tokens": sum(map(len, prompts)),
                "prompts": [args.min_prompt, args.max_prompt], "output": args.output}
    report.write(args.name, headers, rows, {"workload": workload, "runs": results, "options": {k: RUNS[k.partition("#")[0]][1] for k in results}})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
    names = list(results)
    left.barh(names, [results[n]["mean_decode_step_ms"] for n in names])
    left.set(xlabel="mean decode step (ms)", title=f"batch {args.batch}, prompts {args.min_prompt}-{args.max_prompt}")
    right.barh(names, [100 * results[n]["stall_s"] / results[n]["engine_step_s"] for n in names], color="tab:red")
    right.set(xlabel="mapping stall, % of step time")
    fig.tight_layout()
    fig.savefig(Path(report.RESULTS) / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
