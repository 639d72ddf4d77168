"""``peer.py``'s workloads one after another through one in-process engine, each from an empty prefix cache (as
``peer.py`` times them): wall, mapping stall, device time and steps of each. What a workload costs after another
one filled the KV pool -- decode-heavy after shared prefixes took 43-46 s on the H100 where it takes ~20 s alone,
every page it grew into walking every slot (``docs/performance.md``). ``--label`` names the run, so that two
builds (the other's ``kvmem`` first on ``PYTHONPATH``) append to one results file.

    python bench/workload_sequence.py --label new [--workloads prefix decode] [--name workload_sequence_h200]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import kvmem
import report
from cluster.engine import LLM
from peer import WORKLOADS
from worker.config import PRESETS
from worker.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["prefix", "decode"], choices=sorted(WORKLOADS))
    parser.add_argument("--label", required=True)
    parser.add_argument("--kv-memory-gib", type=float, default=40)
    parser.add_argument("--name", default="workload_sequence")
    args = parser.parse_args()
    workloads = {n: WORKLOADS[n] for n in args.workloads}
    if len({w.model for w in workloads.values()}) != 1 or any(w.turns > 1 for w in workloads.values()):
        parser.error("single-turn workloads of one model")
    model = next(iter(workloads.values())).model
    engine_args = dict(max_num_seqs=max(w.requests for w in workloads.values()), max_num_batched_tokens=8192,
                       max_model_len=max(w.max_len for w in workloads.values()),
                       kv_memory=int(args.kv_memory_gib * (1 << 30)), device="cuda", dtype="bfloat16")
    runs = {}
    with LLM(model, **engine_args) as llm:
        llm.generate([[5] * 64] * 8, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
        for name, w in workloads.items():
            prompts, _ = w.prompts(PRESETS[w.model], 0)
            llm.reset_prefix_cache()
            torch.cuda.synchronize()
            before, start = llm.snapshot(), time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=w.output, temperature=0, ignore_eos=True))
            wall, after = time.perf_counter() - start, llm.snapshot()
            runs[name] = {"wall_s": wall, "stall_s": after.workers[0].stall_seconds - before.workers[0].stall_seconds,
                          "device_s": after.workers[0].device_seconds - before.workers[0].device_seconds,
                          "steps": after.num_steps - before.num_steps}
            print(args.label, name, json.dumps(runs[name]), flush=True)
    path = report.RESULTS / f"{args.name}.json"
    previous = json.loads(path.read_text())["runs"] if path.exists() else []
    rows = [[r["label"], name, r[name]["wall_s"], r[name]["stall_s"], r[name]["device_s"], r[name]["steps"]]
            for r in [*previous, {"label": args.label, **runs}] for name in args.workloads]
    report.write(args.name, ["label", "workload", "wall s", "stall s", "device s", "steps"], rows,
                 {"engine_args": engine_args, "kvmem": kvmem.__file__,
                  "runs": [*previous, {"label": args.label, "kvmem": kvmem.__file__, **runs}]})


if __name__ == "__main__":
    main()
