"""A running ``vattn serve``'s steps under load, from the inside: joins its Ray cluster, records every engine replica's
workers under torch's profiler for ``--seconds`` (``SchedulerActor.start_profile``), and writes each step of the trace
(``bench/trace_breakdown.py``'s reading: its host span, its kernels' union, first and last kernel, mapping waited
for, the launch's phases) with a summary of decode-only and prefilling steps and of the device's idle time between
steps, as JSON.

    python bench/serve_trace.py --seconds 2 --out steps.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import ray

import trace_breakdown as tb
from server.engine import scheduler_actors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    ray.init(address="auto", log_to_driver=False)
    actors = scheduler_actors()
    if not actors:
        raise SystemExit("no vattn engine replica runs in this Ray cluster")
    directory = tempfile.mkdtemp(prefix="vattn_serve_trace_")
    result = {}
    for replica, actor in actors.items():
        ray.get(actor.start_profile.remote(f"{directory}/{replica}"))
    time.sleep(args.seconds)
    for replica, actor in actors.items():
        traces = ray.get(actor.stop_profile.remote())
        steps = tb.steps(tb.load(Path(traces[0])), r"^vattn_step_")  # the first worker's: they run the same steps
        result[replica] = {"trace": traces[0], "analysis": tb.timeline(steps),
                           "steps": [asdict(s) | {"by_kernel": None} for s in steps]}
    args.out.write_text(json.dumps(result, indent=1))
    for replica, r in result.items():
        a = r["analysis"]
        print(f"{replica}: {a['steps']} steps, device idle share {a['device_idle_share']}; decode steps' device span "
              f"{a['decode']['device_span_ms']}; prefilling {a['prefilling']['device_span_ms']}", flush=True)


if __name__ == "__main__":
    main()
