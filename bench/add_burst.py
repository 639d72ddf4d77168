"""A burst of one-request calls reaching a scheduler actor, as an ingress sends them when many clients start at once:
one actor call each (``SchedulerActor.add``, as the ingress did before 2026-11-28) against one call for all that came
together (``add_many``, what ``server.outputs.OutputCollector`` sends now). The time until every request is queued, and
until every one has finished (a short prompt and one token each: the engine's own work stays small); alternating the
two ways, ``--rounds`` times each.

    python bench/add_burst.py [--model tiny] [--device cpu] [--burst 64 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import ray

import report
from cluster.engine import LLM
from cluster.scheduler_actor import AddCall
from worker.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


async def burst(actor, n: int, together: bool, consumer: str) -> tuple[float, float]:
    """Seconds until all ``n`` requests were queued, and until all had finished."""
    calls = [AddCall([list(range(10, 210))], PARAMS, True, (uuid.uuid4().hex,), consumer) for _ in range(n)]
    start = time.perf_counter()
    if together:
        errors = await actor.add_many.remote(calls)
        if any(errors):
            raise next(e for e in errors if e)
    else:
        await asyncio.gather(*(actor.add.remote(call) for call in calls))
    queued = time.perf_counter() - start
    left = {call.request_ids[0] for call in calls}
    while left:
        left -= {o.request_id for o in await actor.wait_outputs.remote(None, 1.0, consumer) if o.finished}
    return queued, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--burst", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="add_burst")
    args = parser.parse_args()
    runs = []
    with LLM(args.model, distributed="ray", device=args.device, kv_memory=64 << 20, max_num_seqs=max(args.burst),
             max_model_len=256, max_num_batched_tokens=8192) as llm:
        actor = llm._engine.actor

        async def all_runs():
            for _ in range(args.rounds):
                for together in (False, True, True, False):  # ABBA
                    for n in args.burst:
                        queued, done = await burst(actor, n, together, "bench")
                        runs.append({"burst": n, "together": together, "queued_s": queued, "done_s": done})

        asyncio.run(all_runs())
    ray.shutdown()
    rows = []
    for n in args.burst:
        for together in (False, True):
            mine = [r for r in runs if r["burst"] == n and r["together"] == together]
            rows.append([n, "one call for all" if together else "a call each",
                         1e3 * statistics.median(r["queued_s"] for r in mine), 1e3 * statistics.median(r["done_s"] for r in mine)])
    report.write(args.name, ["burst", "calls", "all queued ms (median)", "all finished ms (median)"], rows,
                 {"model": args.model, "runs": runs})


if __name__ == "__main__":
    main()
