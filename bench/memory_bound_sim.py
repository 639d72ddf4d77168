"""The memory-bound workload of ``peer.py`` through the engine's own scheduler and page ledger, with no model:
how many requests run at once when KV memory is the limit, and how many are preempted.

Every step is scheduled, mapped ahead and completed as the engine does it (two steps in flight with async
scheduling), each sequence that samples gets a token, and a request ends at its ``max_tokens``. What the GPU
adds -- time -- is left out; the admission, reclamation and preemption decisions are the engine's, page for
page (on the H100 the engine ran 905 steps with 39 requests running at the median of the middle half, where this
counted 899 and 39, before the surplus-page fix: ``docs/performance.md``). ``--sequence`` runs ``peer.py``'s
workloads one after another through one scheduler and ledger instead, and times the host's part of each.

    python bench/memory_bound_sim.py [--kv-memory-gib 8] [--requests 256]
    python bench/memory_bound_sim.py --sequence prefix decode --kv-memory-gib 40 --name ledger_sequence_cpu
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from pathlib import Path

import report
from peer_spec import steady_running
from cluster.config import EngineConfig, plan
from cluster.scheduler import Scheduler
from cluster.sequence import Request, Sequence
from kvmem.ledger import PageLedger
from throughput import random_prompts
from worker.config import PRESETS
from worker.sampling import SamplingParams

GiB = 1 << 30


def new_scheduler(model: str, kv_memory: int, max_num_seqs: int, max_model_len: int,
                  max_num_batched_tokens: int) -> tuple[Scheduler, PageLedger, int]:
    """The scheduler and page ledger the engine would build for ``model`` (and the ledger's pages)."""
    config = EngineConfig(model=model, kv_memory=kv_memory, max_num_seqs=max_num_seqs, dtype="bfloat16",
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
    engine_plan = plan(config, PRESETS[model], "cpu")
    ledger = engine_plan.new_ledger()
    return Scheduler(engine_plan.scheduler, ledger), ledger, engine_plan.num_pages


def step_through(scheduler: Scheduler, ledger: PageLedger, prompts: list[list[int]], output: int,
                 in_flight: int) -> list[int]:
    """Run ``prompts`` to ``output`` tokens each as the engine steps them; the requests running in each step."""
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
    return running


def simulate(model: str, prompts: list[list[int]], output: int, kv_memory: int, max_num_batched_tokens: int,
             in_flight: int) -> dict:
    """Run ``prompts`` through a scheduler over the page ledger the engine would build for ``model``."""
    scheduler, ledger, pages = new_scheduler(model, kv_memory, len(prompts), max(map(len, prompts)) + output,
                                             max_num_batched_tokens)
    running = step_through(scheduler, ledger, prompts, output, in_flight)
    return {"steps": len(running), "peak": max(running), "steady": steady_running(running),
            "preemptions": scheduler.num_preemptions, "pages": pages, "running": running}


def sequence(names: list[str], kv_memory: int, max_num_batched_tokens: int) -> list[list]:
    """``peer.py``'s workloads one after another through one engine's scheduler and ledger, as ``peer.py`` runs
    them (each from an empty prefix cache): the host seconds each takes to schedule and account (the GPU's work
    left out)."""
    from peer import WORKLOADS

    workloads = [WORKLOADS[n] for n in names]
    if len({w.model for w in workloads}) != 1 or any(w.turns > 1 for w in workloads):
        raise SystemExit("--sequence: single-turn workloads of one model")
    scheduler, ledger, _ = new_scheduler(workloads[0].model, kv_memory, max(w.requests for w in workloads),
                                         max(w.max_len for w in workloads), max_num_batched_tokens)
    rows = []
    for name, w in zip(names, workloads):
        prompts, _ = w.prompts(PRESETS[w.model], 0)
        (maps, unmaps, _), preempted = ledger.counters(), scheduler.num_preemptions
        start = time.perf_counter()
        ledger.reset_prefixes()  # as peer.py starts every timed run
        running = step_through(scheduler, ledger, prompts, w.output, 2)
        seconds, (maps_after, unmaps_after, _) = time.perf_counter() - start, ledger.counters()
        rows.append([name, len(running), seconds, scheduler.num_preemptions - preempted, maps_after - maps,
                     unmaps_after - unmaps, ledger.kept_pages(), ledger.free_pages()])
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--kv-memory-gib", type=float, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--name", default="memory_bound_sim_cpu")
    parser.add_argument("--sequence", nargs="+", metavar="WORKLOAD",
                        help="instead: these peer.py workloads one after another in one engine (host time per workload)")
    args = parser.parse_args()
    if args.sequence:
        rows = sequence(args.sequence, int(args.kv_memory_gib * GiB), args.max_num_batched_tokens)
        report.write(args.name, ["workload", "steps", "host s", "preemptions", "pages mapped", "pages unmapped",
                                 "cached pages after", "free pages after"],
                     rows, {"args": vars(args)}, Path(report.RESULTS))
        return
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
