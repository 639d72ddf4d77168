"""Control path: one step's round trip from the scheduler to N worker actors and back, with plain Ray actor
calls against a Ray compiled graph, carrying the engine's real messages: a decode ``StepInput`` of B
sequences out, a ``WorkerOutput`` (the sampler's tokens, every worker's report) back. The workers do no
model work (``--work-ms`` makes them sleep as long as a step would run), so the round trip minus that work
is the transport alone.

    python bench/control_path.py [--workers 1 2 4] [--batch 1 64 256] [--work-ms 0 25] [--iters 300]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import ray  # noqa: E402
from ray.dag import InputNode, MultiOutputNode  # noqa: E402

import report  # noqa: E402
from kvmem.ops import Ensure  # noqa: E402
from worker.messages import StepInput, WorkerOutput, WorkerReport  # noqa: E402


@ray.remote(num_cpus=0)
class EchoWorker:
    """Answers a step as a worker would, without running a model."""

    def __init__(self, samples: bool, work_s: float):
        self.samples, self.work_s = samples, work_s
        self.report = WorkerReport(0, 0, 64, 1 << 30, 100, 5000, 10, 0.01, 1.0, 0, (30.0,))

    def step(self, msg: StepInput) -> WorkerOutput:
        if self.work_s:
            time.sleep(self.work_s)
        sampled = {i: (7,) for i in msg.seq_ids} if self.samples else {}
        return WorkerOutput(sampled, self.report)


def decode_step(batch: int, step: int) -> StepInput:
    """A decode step of ``batch`` sequences, each at ~1,000 tokens, a few crossing into a new page."""
    seqs = tuple(range(batch))
    return StepInput(step, (), (), tuple(Ensure(s, 1001 + step) for s in seqs[: batch // 16]),
                     {s: 1002 + step for s in seqs}, seqs, seqs, (1000 + step,) * batch, (1,) * batch,
                     (step,) * batch, tuple(range(batch)), tuple(range(batch + 1)))


def timed(fn, iters: int) -> list[float]:
    for _ in range(20):
        fn(0)
    out = []
    for i in range(iters):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def measure(workers: int, batch: int, work_ms: float, iters: int) -> dict:
    actors = [EchoWorker.remote(i == workers - 1, work_ms / 1e3) for i in range(workers)]
    msgs = [decode_step(batch, i) for i in range(8)]
    plain = timed(lambda i: ray.get([a.step.remote(msgs[i % 8]) for a in actors]), iters)
    with InputNode() as inp:
        dag = MultiOutputNode([a.step.bind(inp) for a in actors])
    graph = dag.experimental_compile()
    compiled = timed(lambda i: ray.get(graph.execute(msgs[i % 8])), iters)
    graph.teardown()
    for a in actors:
        ray.kill(a)
    # What is left of a round trip once the workers' own time is taken off.
    return {"workers": workers, "batch": batch, "work_ms": work_ms, "message_bytes": len(pickle.dumps(msgs[0])),
            "plain_ms": [t - work_ms for t in plain], "compiled_ms": [t - work_ms for t in compiled]}


def plot(results: list[dict], path: Path) -> None:
    results = [r for r in results if r["work_ms"] == 0]
    batches = sorted({r["batch"] for r in results})
    fig, axes = plt.subplots(1, len(batches), figsize=(3.2 * len(batches), 3), sharey=True)
    for ax, batch in zip(axes if len(batches) > 1 else [axes], batches):
        rows = [r for r in results if r["batch"] == batch]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [statistics.median(r["plain_ms"]) for r in rows], 0.4, label="plain actor calls")
        ax.bar([i + 0.2 for i in x], [statistics.median(r["compiled_ms"]) for r in rows], 0.4, label="compiled graph")
        ax.set_xticks(list(x), [str(r["workers"]) for r in rows])
        ax.set_xlabel(f"workers (decode batch {batch})")
    (axes[0] if len(batches) > 1 else axes).set_ylabel("step round trip, median ms")
    (axes[0] if len(batches) > 1 else axes).legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--work-ms", type=float, nargs="+", default=[0.0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    parser.add_argument("--name", default="control_path_cpu")
    args = parser.parse_args()
    ray.init(num_cpus=max(args.workers) + 1, include_dashboard=False, log_to_driver=False)
    results = [measure(w, b, ms, args.iters if not ms else max(40, args.iters // 5))
               for ms in args.work_ms for b in args.batch for w in args.workers]
    ray.shutdown()
    rows = []
    for r in results:
        p50p, p50c = statistics.median(r["plain_ms"]), statistics.median(r["compiled_ms"])
        p90 = lambda xs: statistics.quantiles(xs, n=10)[-1]  # noqa: E731
        rows.append([r["workers"], r["batch"], r["work_ms"], r["message_bytes"], p50p, p90(r["plain_ms"]), p50c, p90(r["compiled_ms"]),
                     p50p / p50c])
    headers = ["workers", "decode batch", "worker ms (taken off)", "message bytes", "plain p50 ms", "plain p90 ms", "compiled p50 ms",
               "compiled p90 ms", "plain / compiled"]
    report.write(args.name, headers, rows, {"runs": results}, args.out)
    plot(results, args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
