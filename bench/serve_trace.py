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
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import ray

import trace_breakdown as tb
from server.engine import scheduler_actors


def quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    values = sorted(values)
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))]
    return {"n": len(values), "mean": statistics.mean(values), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "max": values[-1]}


def analyse(steps: list[tb.Step]) -> dict:
    """Per kind of step (decode only / prefilling): host span, kernel union and the device span to the next step's
    first kernel (ms); and the device's idle time between one step's last kernel and the next's first."""
    timed = [s for s in steps if s.first_kernel_us is not None]
    spans = {id(a): (b.first_kernel_us - a.first_kernel_us) / 1e3 for a, b in zip(timed, timed[1:])}
    idle = [max(0.0, (b.first_kernel_us - a.last_kernel_end_us) / 1e3) for a, b in zip(timed, timed[1:])]
    out = {"steps": len(steps), "device_idle_between_steps_ms": quantiles(idle),
           "device_idle_share": sum(idle) / sum(spans.values()) if spans else None}
    for kind, chosen in (("decode", [s for s in timed if "prefill(0)" in s.name]),
                         ("prefilling", [s for s in timed if "prefill(0)" not in s.name])):
        out[kind] = {"host_ms": quantiles([s.host_us / 1e3 for s in chosen]),
                     "kernel_ms": quantiles([s.kernel_us / 1e3 for s in chosen]),
                     "device_span_ms": quantiles([spans[id(s)] for s in chosen if id(s) in spans]),
                     "map_wait_ms": quantiles([s.map_wait_us / 1e3 for s in chosen]),
                     "summary": tb.summarize(chosen, top=6)}
    return out


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
        result[replica] = {"trace": traces[0], "analysis": analyse(steps),
                           "steps": [asdict(s) | {"by_kernel": None} for s in steps]}
    args.out.write_text(json.dumps(result, indent=1))
    for replica, r in result.items():
        a = r["analysis"]
        print(f"{replica}: {a['steps']} steps, device idle share {a['device_idle_share']}; decode steps' device span "
              f"{a['decode']['device_span_ms']}; prefilling {a['prefilling']['device_span_ms']}", flush=True)


if __name__ == "__main__":
    main()
