"""Tensor parallelism on one host, without the engine around it: each rank a process with its shard of the model
(NCCL between them), its KV cache and a ``ModelRunner``, stepping the same batch in lock-step -- prefill chunks,
then decode steps eager and in CUDA graphs (the all-reduces captured in each rank's graphs). Per TP size: ms per
prefill step of ``--chunk`` tokens and per decode step of ``--batch`` sequences, and the ratio to TP=1.
With several ranks, each ``--all-reduce`` in turn: ``nccl`` (every sum), ``peer`` (small sums through peer memory,
``worker.peer_all_reduce``: torch's one-shot kernel), ``lamport`` (the same through our Lamport kernel, the engine's default), ``overlap``
(peer, and prefill products of ``--overlap-rows`` rows or more in halves whose sums overlap the next half's product:
``TPGroup.overlap_rows``), ``none`` (no sums at all: wrong tokens, the communication's share of a step). ``--profile
N``: N more decode steps of each kind under torch.profiler on rank 0, its kernel time by kind (matmul, attention,
all-reduce, norm, ...) per step: what a TP rank's step does not halve.

    python bench/tp_decode_graphs.py --tp 1 2 [--all-reduce nccl peer lamport overlap none] [--model llama-3-8b]
        [--batch 128] [--attention flash_attn] [--profile 5]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import replace

import torch
import torch.multiprocessing as mp

import report
from kvmem import KVCacheSpec, VirtualKVCache
from kvmem.vmm import default_vmm
from worker.attention import get_backend
from worker.loader import build_model
from worker.parallel import TPGroup
from worker.peer_all_reduce import PeerAllReduce
from worker.runner import ModelRunner, ScheduledChunk, StepPlan
from worker.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)


def _timed(fn, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` calls, the device drained before and after each."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _kernels(fn, steps: int) -> dict:
    """``steps`` calls under the profiler: per step, the union of this rank's kernel time, that time by kind, and
    the kernels that took the most."""
    from torch.profiler import ProfilerActivity, profile

    from step_profile import kernel_kinds, kernel_seconds

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    busy, top = kernel_seconds(prof)
    return {"kernel_ms": busy * 1e3 / steps, "by_kind_ms": {k: t * 1e3 / steps for k, t in kernel_kinds(prof).items()},
            "top_ms": [(n, t * 1e3 / steps, c // steps) for n, t, c in top]}


def _say(rank: int, what: str) -> None:
    print(f"rank {rank}: {what}", file=sys.stderr, flush=True)


class NoSums:
    """``--all-reduce none``: every partial sum left as it is (and no barrier: graphs hold no collective)."""

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def rank_main(rank: int, size: int, mode: str, init: str, args: argparse.Namespace, out: str) -> None:
    faulthandler.dump_traceback_later(args.hang_s, repeat=True)  # a rank stuck in a collective shows where
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    if size > 1:
        torch.distributed.init_process_group("nccl", init_method=init, rank=rank, world_size=size, device_id=device)
    try:
        tp = TPGroup()
        if size > 1:
            tp = TPGroup(rank, size, overlap_rows=args.overlap_rows if mode == "overlap" else 0)
            kernel = "lamport" if mode == "lamport" else "one_shot"
            peers = ("peer", "lamport", "overlap")
            peer = (NoSums() if mode == "none" else
                    PeerAllReduce.connect(tp, device, kernel=kernel) if mode in peers else None)
            if mode in peers and peer is None:
                raise RuntimeError(f"--all-reduce {mode}: symmetric memory failed here (see the warning)")
            tp = replace(tp, peer=peer)
        model = build_model(args.model, torch.bfloat16, device, tp, seed=0)
        _say(rank, "model built")
        c = model.config
        steps = args.warmup + args.steps + args.profile  # decode steps of each runner: max_tokens holds both runners
        max_tokens = args.context + 2 * steps + 1
        spec = KVCacheSpec(c.num_layers, c.num_kv_heads // size, c.head_dim, torch.bfloat16, args.batch + 1,
                           max_tokens, "mega", 2 << 20)
        pool = (args.batch + 1) * spec.pages_for(max_tokens) * spec.num_buffers * spec.page_size
        result = {"tp": size, "all_reduce": mode}
        with VirtualKVCache(spec, pool, default_vmm(device)) as cache:
            slots = [cache.alloc_slot(max_tokens) for _ in range(args.batch)]
            scratch = cache.alloc_slot(1)
            cache.ensure(scratch, 1)
            for slot in slots:
                cache.ensure(slot, max_tokens)
            backend = get_backend(args.attention, device)
            prompts = torch.randint(3, c.vocab_size, (args.batch, args.context), generator=torch.Generator().manual_seed(1))
            eager = ModelRunner(model, cache, backend, device, samples=rank == 0, tp=tp)
            # Prefill: chunks of --chunk tokens over the sequences in order (the last timed ones are full chunks).
            plans, rows, chunks = [], [], []
            for i, slot in enumerate(slots):
                for start in range(0, args.context, args.chunk):
                    tokens = tuple(prompts[i, start : start + args.chunk].tolist())
                    last = start + len(tokens) == args.context
                    chunks.append(ScheduledChunk(i, slot, tokens, start, 1 if last else 0, GREEDY, 0, 0))
                    rows.append(len(tokens))
                    if sum(rows) >= args.chunk:
                        plans.append(StepPlan(tuple(chunks)))
                        chunks, rows = [], []
            if chunks:
                plans.append(StepPlan(tuple(chunks)))
            prefill = []
            for plan in plans:
                prefill += _timed(lambda p=plan: eager.execute(p), 1)
            full = prefill[1:-1] or prefill
            _say(rank, f"prefilled in {len(plans)} steps")
            result["prefill_ms"] = statistics.median(full)
            result["prefill_tokens"] = args.chunk
            # Decode: every sequence one token a step, eager then in graphs, positions advancing.
            position = [args.context]

            def decode(runner: ModelRunner) -> None:
                p = position[0]
                runner.execute(StepPlan(tuple(ScheduledChunk(i, slot, (7,), p, 1, GREEDY, 0, p - args.context + 1)
                                              for i, slot in enumerate(slots))))
                position[0] += 1

            graphed = ModelRunner(model, cache, backend, device, args.batch, scratch, samples=rank == 0, tp=tp)
            for name, runner in (("eager", eager), ("graphs", graphed)):
                _timed(lambda r=runner: decode(r), args.warmup)  # the graphs' capture, cuBLAS's first shapes
                _say(rank, f"decode {name} warm")
                times = _timed(lambda r=runner: decode(r), args.steps)
                result[f"decode_{name}_ms"] = statistics.median(times)
                result[f"decode_{name}_raw"] = times
                if args.profile:  # on every rank: their collectives pair up; rank 0's result is kept
                    result[f"decode_{name}_kernels"] = _kernels(lambda r=runner: decode(r), args.profile)
            graphed.close()  # before the process group: destroying it under live graphs hung on 2xH200
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    except BaseException:
        # Now, not after tearing NCCL down: with the peer still inside a collective that would never return.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if size > 1:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--all-reduce", nargs="+", default=["nccl", "peer"],
                        choices=["nccl", "peer", "lamport", "overlap", "none"])
    parser.add_argument("--overlap-rows", type=int, default=2048)
    parser.add_argument("--attention", default="fa2")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, help="decode steps of each kind profiled on rank 0")
    parser.add_argument("--hang-s", type=float, default=120, help="dump every rank's stack after this long, and again")
    parser.add_argument("--name", default="tp_decode_graphs")
    args = parser.parse_args()
    if max(args.tp) > torch.cuda.device_count():
        parser.error(f"--tp {max(args.tp)} needs that many GPUs, this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (the machines' rule)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(size, mode) for size in args.tp for mode in (args.all_reduce if size > 1 else ["-"])]
        for i, (size, mode) in enumerate(runs):
            out = os.path.join(tmp, f"run{i}.json")
            mp.spawn(rank_main, args=(size, mode, f"file://{tmp}/rendezvous{i}", args, out), nprocs=size, join=True)
            with open(out) as f:
                results.append(json.load(f))
            print(json.dumps({k: v for k, v in results[-1].items() if not k.endswith(("_raw", "_kernels"))}), flush=True)
            for name in ("eager", "graphs"):
                if f"decode_{name}_kernels" in results[-1]:
                    k = results[-1][f"decode_{name}_kernels"]
                    kinds = "  ".join(f"{kind} {ms:.2f}" for kind, ms in k["by_kind_ms"].items())
                    print(f"  TP={size} {mode} decode {name}, rank 0 kernels {k['kernel_ms']:.2f} ms a step: {kinds}",
                          flush=True)
    base = results[0]
    rows = [[r["tp"], r["all_reduce"], r["prefill_ms"], r["prefill_ms"] / base["prefill_ms"], r["decode_eager_ms"],
             r["decode_graphs_ms"], r["decode_graphs_ms"] / base["decode_graphs_ms"]] for r in results]
    report.write(args.name, ["TP", "all-reduce", f"prefill ms ({args.chunk} tokens)", "x first",
                             f"decode eager ms ({args.batch})", "decode graphs ms", "graphs x first"], rows,
                 {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
