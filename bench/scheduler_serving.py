"""The scheduler's own time per step while serving: a closed loop of clients (each sends its next request as soon as
its last one ends, as ``bench/serving.py``'s clients do) over the ``llama-3-8b`` ledger of a 40 GiB pool, random
prompts, prefix caching on -- so that after the first few hundred requests the pool is full of cached pages and every
new page is evicted and reclaimed for. ``schedule``, ``lookahead``, the recorded KV operations and ``postprocess`` per
step, no model and no workers (``bench/scheduler_overhead.py`` runs the offline workloads the same way). The mean and
the 99th percentile over the second half of the steps: the step loop's share of a decode step, and its stalls; and
the page maps and unmaps per request the workers replay (the ledger counts them as a worker's cache does), in a step's
own launch and ahead of it on the mapper thread.

    python bench/scheduler_serving.py [--clients 64 256]                # this tree
    python bench/scheduler_serving.py --a /tmp/before --b . [--clients 64 256]   # two trees, ABBA, each run its own process
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import report


class CollectorPauses:
    """The cyclic garbage collector's collections of generations 1 and 2 while it is on (``gc.callbacks``): their
    count and seconds, as the step loop's process would stand still for them."""

    def __init__(self):
        self.pauses: list[float] = []
        self._start = 0.0

    def start(self) -> None:
        gc.callbacks.append(self._record)

    def stop(self) -> None:
        gc.callbacks.remove(self._record)

    def _record(self, phase: str, info: dict) -> None:
        if info["generation"] == 0:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._start)


def closed_loop(clients: int, steps: int, kv_gib: int, seed: int, release: bool = True,
                eager_slots: int | None = None, prefixes: int = 0, prefix_len: int = 0, own: int = 512,
                fused: int = 0) -> dict:
    """``steps`` scheduler steps of ``clients`` clients (``own``-token random prompts, 128 tokens out, greedy; with
    ``prefixes``, each prompt starts with one of that many shared ``prefix_len``-token prefixes drawn at random, as
    ``bench/serving.py --prefixes`` sends them; ``fused``: the engine's ``fused_prefix_pages``). A finished request is let go of as ``EngineCore`` does
    (``Request.release``); ``release=False`` leaves it to the cyclic collector, as before 2026-11-28. ``eager_slots``:
    the engine's option (None: its default, or a tree's without it)."""
    from cluster.config import EngineConfig, model_config, plan
    from cluster.scheduler import Scheduler
    from cluster.sequence import Request, Sequence
    from worker.sampling import SamplingParams

    config = EngineConfig("llama-3-8b", max_num_seqs=256, max_num_batched_tokens=8192,
                          max_model_len=prefix_len + own + 128 + 64,
                          kv_memory=kv_gib << 30, dtype="bfloat16", enable_prefix_caching=True,
                          **({} if eager_slots is None else {"eager_slots": eager_slots}),
                          **({"fused_prefix_pages": fused} if fused else {}))
    engine_plan = plan(config, model_config("llama-3-8b"), "cuda")
    ledger = engine_plan.new_ledger()
    scheduler = Scheduler(engine_plan.scheduler, ledger)
    rng = random.Random(seed)
    shared = [[rng.randrange(32000) for _ in range(prefix_len)] for _ in range(prefixes)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    added = 0

    def add() -> None:
        nonlocal added
        prompt = (rng.choice(shared) if shared else []) + [rng.randrange(32000) for _ in range(own)]
        request = Request(str(added), None, tuple(prompt), params, 0)
        request.seqs.append(Sequence(scheduler.new_seq_id(), request, 0, prompt))
        scheduler.add(request.seqs[0])
        added += 1

    gc.collect()
    gc.freeze()  # what was built so far, as ``worker.heap.freeze_heap`` does once an engine is up
    for _ in range(clients):
        add()
    times, ahead, moves, finished, calls = [], [], [], [], []
    collector = CollectorPauses()
    for i in range(steps):
        if i == steps // 2:
            collector.start()
        start = time.perf_counter()
        before, called = ledger.counters()[:2], ledger.mapping_calls()
        out = scheduler.schedule()
        in_step = ledger.counters()[:2]
        planned = scheduler.lookahead(out)  # before the operations are taken, as the engine does
        mapped = ledger.counters()[:2]
        ledger.take_ops()
        ended = 0
        for seq in scheduler.postprocess(out, {s.seq.seq_id: (7,) * s.num_samples for s in out.scheduled if s.num_samples}):
            if seq.num_output_tokens >= params.max_tokens:
                scheduler.finish(seq, "length")
                if release:
                    seq.request.release()
                ended += 1
        times.append(time.perf_counter() - start)
        ahead.append(len(planned.needs) / max(1, len(out.scheduled)))
        # Page maps and unmaps the workers replay: in the step's launch (its recorded operations), and ahead of it
        moves.append((in_step[0] - before[0], in_step[1] - before[1], mapped[0] - in_step[0], mapped[1] - in_step[1]))
        finished.append(ended)
        calls.append(ledger.mapping_calls() - called)
        for _ in range(ended):
            add()
    collector.stop()
    gc.unfreeze()
    tail = sorted(times[steps // 2:])
    ended = max(1, sum(finished[steps // 2:]))
    per_request = [sum(m[k] for m in moves[steps // 2:]) / ended for k in range(4)]
    return {"clients": clients, "steps": steps, "requests": added, "pages": engine_plan.num_pages,
            "us_per_step": 1e6 * statistics.fmean(tail), "p99_us": 1e6 * tail[int(0.99 * len(tail))],
            "max_us": 1e6 * tail[-1], "mapped_ahead_share": statistics.fmean(ahead[steps // 2:]),
            "collections": len(collector.pauses), "collection_ms": 1e3 * sum(collector.pauses),
            "collection_max_ms": 1e3 * max(collector.pauses, default=0.0),
            "maps_in_step_per_request": per_request[0], "unmaps_in_step_per_request": per_request[1],
            "maps_ahead_per_request": per_request[2], "unmaps_ahead_per_request": per_request[3],
            # allocations mapped, in the step and ahead (a fused run's pages are one): what the driver pays for
            "mappings_per_request": sum(calls[steps // 2:]) / ended, "runs_fused": ledger.prefix_runs_fused}


def in_tree(tree: Path, args) -> list[dict]:
    """This script's own runs with ``tree``'s code, in a process of their own."""
    env = report.tree_env(tree)
    done = subprocess.run([sys.executable, __file__, "--json", "--clients", *map(str, args.clients), "--steps",
                           str(args.steps), "--kv-gib", str(args.kv_gib), "--seed", str(args.seed),
                           *(["--eager-slots", str(args.eager_slots)] if args.eager_slots is not None else []),
                           *(["--prefixes", str(args.prefixes), "--prefix-len", str(args.prefix_len)]
                             if args.prefixes else []), "--input", str(args.input),
                           *(["--fused-prefix-pages", str(args.fused_prefix_pages)] if args.fused_prefix_pages else [])],
                          env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def release_ab(args) -> None:
    """``closed_loop`` with finished requests left to the collector (A) and released (B), ABBA, per client count:
    the step's mean, p99 and max, and the collector's pauses of generations 1 and 2."""
    runs = [{"side": side, "runs": [closed_loop(c, args.steps, args.kv_gib, args.seed, release=side == "B")
                                    for c in args.clients]} for side in "ABBA"]
    keys = ("us_per_step", "p99_us", "max_us", "collections", "collection_ms", "collection_max_ms")
    rows = [[c, side, *(statistics.fmean(x[k] for r in runs if r["side"] == side for x in r["runs"] if x["clients"] == c)
                        for k in keys)] for c in args.clients for side in "AB"]
    report.write(args.name, ["clients", "side", "us / step", "p99 us", "max us", "collections (gen 1-2)",
                             "collected ms", "longest ms"], rows,
                 {"sides": {"A": "finished requests left to the cyclic collector", "B": "released (Request.release)"},
                  "order": "ABBA", "runs": runs, "kv_gib": args.kv_gib, "steps": args.steps}, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=3000, help="per run; the second half is measured")
    parser.add_argument("--kv-gib", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--a", type=Path, help="with --b: compare two trees, ABBA")
    parser.add_argument("--b", type=Path)
    parser.add_argument("--json", action="store_true", help="print the runs as JSON (what --a/--b read)")
    parser.add_argument("--release-ab", action="store_true", help="this tree, finished requests left to the cyclic "
                        "collector (A) and let go of (B, as the engine does), ABBA in this process")
    parser.add_argument("--eager-slots", type=int, help="EngineConfig.eager_slots of the runs (default: the engine's)")
    parser.add_argument("--prefixes", type=int, default=0, help="shared prefixes: each prompt starts with one of "
                        "this many (drawn at random) of --prefix-len tokens")
    parser.add_argument("--prefix-len", type=int, default=0)
    parser.add_argument("--input", type=int, default=512, help="each prompt's own tokens (after its prefix)")
    parser.add_argument("--fused-prefix-pages", type=int, default=0, help="the engine's option (0: off)")
    parser.add_argument("--name", default="scheduler_serving")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    args = parser.parse_args()
    if args.json:
        print(json.dumps([closed_loop(c, args.steps, args.kv_gib, args.seed, eager_slots=args.eager_slots,
                                      prefixes=args.prefixes, prefix_len=args.prefix_len, own=args.input,
                                      fused=args.fused_prefix_pages)
                          for c in args.clients]))
        return
    if args.release_ab:
        release_ab(args)
        return
    if (args.a is None) != (args.b is None):
        sys.exit("--a and --b go together")
    trees = {"A": args.a.resolve(), "B": args.b.resolve()} if args.a else {"this": Path(__file__).resolve().parents[1]}
    order = "ABBA" if args.a else ["this"]
    runs = [{"side": side, "runs": in_tree(trees[side], args)} for side in order]
    rows = []
    for c in args.clients:
        for side in trees:
            mine = [x for r in runs if r["side"] == side for x in r["runs"] if x["clients"] == c]
            rows.append([c, side, statistics.fmean(x["us_per_step"] for x in mine), statistics.fmean(x["p99_us"] for x in mine),
                         max(x["max_us"] for x in mine), statistics.fmean(x["mapped_ahead_share"] for x in mine),
                         *(statistics.fmean(x[k] for x in mine) for k in ("maps_in_step_per_request",
                           "unmaps_in_step_per_request", "maps_ahead_per_request", "unmaps_ahead_per_request",
                           "mappings_per_request"))])
    report.write(args.name, ["clients", "tree", "us / step", "p99 us", "max us", "mapped ahead", "maps in step / req",
                             "unmaps in step / req", "maps ahead / req", "unmaps ahead / req", "allocations mapped / req"],
                 rows,
                 {"trees": {k: str(v) for k, v in trees.items()}, "order": list(order), "runs": runs,
                  "kv_gib": args.kv_gib, "steps": args.steps, "prefixes": args.prefixes,
                  "prefix_len": args.prefix_len, "input": args.input, "fused_prefix_pages": args.fused_prefix_pages},
                 args.out)


if __name__ == "__main__":
    main()
