"""The memory-bound workload of ``peer.py`` through the engine's own scheduler and page ledger, with no model:
how many requests run at once when KV memory is the limit, and how many are preempted.

Every step is scheduled, mapped ahead and completed as the engine does it (two steps in flight with async
scheduling), each sequence that samples gets a token, and a request ends at its ``max_tokens``. What the GPU
adds -- time -- is left out; the admission, reclamation and preemption decisions are the engine's, page for
page (on the H100 the engine ran 905 steps with 39 requests running at the median of the middle half, where this
counted 899 and 39, before the surplus-page fix: ``docs/performance.md``).

    python bench/memory_bound_sim.py [--kv-memory-gib 8] [--requests 256]
"""

from __future__ import annotations

import argparse
from collections import deque
from pathlib import Path

import report
from peer_spec import steady_running
from cluster.config import EngineConfig, plan
from cluster.scheduler import Scheduler
from cluster.sequence import Request, Sequence
from throughput import random_prompts
from worker.config import PRESETS
from worker.sampling import SamplingParams

GiB = 1 << 30


def simulate(model: str, prompts: list[list[int]], output: int, kv_memory: int, max_num_batched_tokens: int,
             in_flight: int) -> dict:
    """Run ``prompts`` through a scheduler over the page ledger the engine would build for ``model``."""
    config = EngineConfig(model=model, kv_memory=kv_memory, max_num_seqs=len(prompts), dtype="bfloat16",
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max(map(len, prompts)) + output)
    engine_plan = plan(config, PRESETS[model], "cpu")
    ledger = engine_plan.new_ledger()
    scheduler = Scheduler(engine_plan.scheduler, ledger)
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        request = Request(str(i), None, tuple(prompt), params, 0)
        seq = Sequence(scheduler.new_seq_id(), request, 0, list(prompt))
        request.seqs.append(seq)
        scheduler.add(seq)
    queued, running = deque(), []
    while scheduler.has_work or queued:
        submitted = False
        if len(queued) < in_flight:
            out = scheduler.schedule()
            if out.scheduled:
                scheduler.lookahead(out)
                ledger.take_ops()
                queued.append(out)
                submitted = True
        if queued and (len(queued) == in_flight or not submitted):
            out = queued.popleft()
            updated = scheduler.postprocess(out, {s.seq.seq_id: (7,) * s.num_samples for s in out.scheduled
                                                  if s.num_samples})
            running.append(len(updated))
            for seq in updated:
                if seq.num_generated >= output:
                    scheduler.finish(seq, "length")
    return {"steps": len(running), "peak": max(running), "steady": steady_running(running),
            "preemptions": scheduler.num_preemptions, "pages": engine_plan.num_pages, "running": running}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--kv-memory-gib", type=float, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--name", default="memory_bound_sim_cpu")
    args = parser.parse_args()
    prompts = random_prompts(PRESETS[args.model], args.requests, 512, 2048)
    rows, data = [], {}
    for in_flight in (1, 2):
        r = simulate(args.model, prompts, args.output, int(args.kv_memory_gib * GiB), args.max_num_batched_tokens,
                     in_flight)
        data[f"in_flight={in_flight}"] = r
        rows.append([in_flight, r["steps"], r["peak"], r["steady"], r["preemptions"], r["pages"]])
    report.write(args.name, ["steps in flight", "steps", "peak running", "steady running", "preemptions",
                             "KV pages (K+V pairs)"], rows, {"args": vars(args), "runs": data}, Path(report.RESULTS))


if __name__ == "__main__":
    main()
