"""The scheduler's own time on a workload, with prefix caching on and off: the whole run of ``schedule`` (and
``lookahead``, and the page ledger's bookkeeping and recorded KV operations) and ``postprocess``, with no model and no
workers -- the CPU cost the step loop pays before the GPU sees a step. The sampled tokens are a constant.

    python bench/scheduler_overhead.py [--workload w1 prefix] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import report
from cluster.config import EngineConfig, model_config, plan
from cluster.scheduler import Scheduler
from cluster.sequence import Request, Sequence
from peer import WORKLOADS
from worker.config import PRESETS
from worker.sampling import SamplingParams


def run(workload: str, caching: bool, seed: int) -> dict:
    """One run of ``workload``'s first turn through a scheduler sized as ``bench/peer.py`` sizes vattn (40 GiB)."""
    w = WORKLOADS[workload]
    config = EngineConfig(w.model, max_num_seqs=w.requests, max_num_batched_tokens=8192, max_model_len=w.max_len,
                          kv_memory=40 << 30, dtype="bfloat16", enable_prefix_caching=caching)
    engine_plan = plan(config, model_config(w.model), "cuda")
    ledger = engine_plan.new_ledger()
    scheduler = Scheduler(engine_plan.scheduler, ledger)
    prompts, _ = w.prompts(PRESETS[w.model], seed)
    params = SamplingParams(max_tokens=w.output, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        request = Request(str(i), None, tuple(p), params, 0)
        request.seqs.append(Sequence(scheduler.new_seq_id(), request, 0, list(p)))
        scheduler.add(request.seqs[0])
    steps, ops = 0, 0
    start = time.perf_counter()
    while scheduler.has_work:
        out = scheduler.schedule()
        scheduler.lookahead(out)
        ops += len(ledger.take_ops())
        for seq in scheduler.postprocess(out, {s.seq.seq_id: (7,) * s.num_samples for s in out.scheduled if s.num_samples}):
            if seq.num_output_tokens >= w.output:
                scheduler.finish(seq, "length")
        steps += 1
    wall = time.perf_counter() - start
    return {"wall_s": wall, "steps": steps, "ops": ops, "us_per_step": 1e6 * wall / steps,
            "hit_rate": scheduler.prefix_hits / scheduler.prefix_queries if scheduler.prefix_queries else None,
            "ideal_hit_rate": ideal_hit_rate(w, ledger.spec, prompts, seed) if caching else None}


def ideal_hit_rate(w, spec, prompts: list[list[int]], seed: int) -> float | None:
    """What a cache of this page size could find at best: every request after the first on a shared prefix maps
    the prefix's whole pages."""
    if not w.prefixes or w.turns > 1:
        return None
    shared = w.shared_prefixes(PRESETS[w.model], seed)
    hits = sum(spec.tokens_within(spec.full_pages(len(shared[i % w.prefixes]))) for i in range(w.prefixes, len(prompts)))
    return hits / sum(map(len, prompts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["w1", "prefix"], choices=sorted(WORKLOADS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="scheduler_overhead")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    args = parser.parse_args()
    rows, raw = [], {}
    for name in args.workload:
        for caching in (False, True):  # alternated within each rep below: drift lands on both
            raw[f"{name} {'on' if caching else 'off'}"] = []
        for _ in range(args.reps):
            for caching in (False, True):
                raw[f"{name} {'on' if caching else 'off'}"].append(run(name, caching, args.seed))
        for caching in (False, True):
            runs = raw[f"{name} {'on' if caching else 'off'}"]
            rows.append([name, "on" if caching else "off", runs[0]["steps"], statistics.median(r["wall_s"] for r in runs),
                         statistics.median(r["us_per_step"] for r in runs), runs[0]["ops"], runs[0]["hit_rate"],
                         runs[0]["ideal_hit_rate"]])
    report.write(args.name, ["workload", "prefix caching", "steps", "scheduler s", "us / step", "KV ops", "hit rate",
                             "ideal"], rows, {"runs": raw, "reps": args.reps}, args.out)


if __name__ == "__main__":
    main()
