"""Memory at a fixed KV budget: on W1's requests (``throughput.py``'s workload), the largest batch each KV layout
runs at once within ``--kv-memory-gib`` of physical KV memory, and the peak physical KV it maps.

A layout's granularity decides it: ``mega`` maps 2 MiB pages that span every layer (32 tokens of Llama-3-8B),
``per_layer`` 2 MiB pages of one layer's K or V (1024 tokens), ``paged`` blocks of 256 tokens (flash-attn's paged
kernel) or 16 (the gather path). Also printed: the batch the budget would hold if every request were at its
longest at once, from each layout's page arithmetic alone.

    python bench/memory_budget.py [--kv-memory-gib 8] [--runs mega per_layer paged paged:paged]
"""

from __future__ import annotations

import argparse
import time

import report
from cluster.engine import LLM
from throughput import GiB, random_prompts
from worker.config import PRESETS
from worker.sampling import SamplingParams


def run(model: str, spec: str, prompts: list[list[int]], output: int, kv_memory: int, batched_tokens: int, device: str) -> dict:
    layout, _, attention = spec.partition(":")
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    with LLM(model, kv_layout=layout, attention=attention or None, kv_memory=kv_memory, max_num_seqs=len(prompts),
             max_model_len=max(map(len, prompts)) + output, max_num_batched_tokens=batched_tokens, device=device,
             dtype="bfloat16" if device == "cuda" else "float32", **({} if device == "cuda" else {"page_size": 4096})) as llm:
        core = llm.core
        ledger_spec = core.plan.ledger_spec
        # what the budget holds with every request at its longest, from the page arithmetic alone
        need = sorted(ledger_spec.pages_for(len(p) + output) for p in prompts)
        fits = next((i for i in range(len(need) + 1) if sum(need[:i]) > core.plan.slot_pages), len(need) + 1) - 1
        for p in prompts:
            llm.add_request(p, params)
        start, largest, finished = time.perf_counter(), 0, 0
        while core.has_work:
            finished += sum(o.finished for o in llm.step())
            if core.last_step is not None:
                largest = max(largest, core.last_step.num_seqs)
        wall = time.perf_counter() - start
        snap = llm.snapshot()
    return {"largest_batch": largest, "batch_at_longest": fits, "preemptions": snap.num_preemptions,
            "peak_kv_bytes": snap.workers[0].peak_mapped_bytes, "wall_s": wall, "finished": finished,
            "granularity_tokens": ledger_spec.page_size if layout == "paged" else ledger_spec.page_size // ledger_spec.token_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--runs", nargs="+", default=["mega", "per_layer", "paged", "paged:paged"])
    parser.add_argument("--kv-memory-gib", type=float, default=8)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--device", default="cuda", help="cpu (with --model tiny): a smoke run")
    parser.add_argument("--name", default="memory_budget")
    args = parser.parse_args()
    config = PRESETS[args.model]
    prompts = random_prompts(config, args.requests, 512, 2048)  # W1's
    results = {spec: run(args.model, spec, prompts, args.output, int(args.kv_memory_gib * GiB), args.max_num_batched_tokens,
                         args.device) for spec in args.runs}
    rows = [[spec, r["granularity_tokens"], r["largest_batch"], r["batch_at_longest"], r["preemptions"],
             r["peak_kv_bytes"] / GiB, r["wall_s"]] for spec, r in results.items()]
    report.write(args.name, ["run", "tokens a page", "largest batch", "batch at longest", "preemptions",
                             "peak KV GiB", "wall s"], rows,
                 {"kv_memory_gib": args.kv_memory_gib, "requests": args.requests, "output": args.output, "runs": results})


if __name__ == "__main__":
    main()
