"""End-to-end throughput: the engine on each KV layout against HF transformers continuous batching.

Workload (fixed seed): ``--requests`` prompts of random token ids, lengths uniform in [min, max], each
generating ``--output`` tokens greedily with EOS ignored, all submitted at once. The same random weights
serve every run (the HF peer's, copied into our model). Also measured in the same run: the bf16 matmul rate
and the device copy bandwidth, which give the roofline floor (prefill FLOPs / matmul rate + decode bytes /
copy bandwidth).

    python bench/throughput.py [--model llama-3-8b] [--layouts mega per_layer paged] [--no-hf]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import re
import statistics
import time
import traceback
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import report  # noqa: E402
from cluster.engine import LLM  # noqa: E402
from worker.config import PRESETS, ModelConfig  # noqa: E402
from worker.loader import empty_model, load_state_dict  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402

GiB = 1 << 30


def random_prompts(config: ModelConfig, requests: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``requests`` prompts of random token ids, lengths uniform in [lo, hi] (W1: 128 in [512, 2048], seed 0).
    Ids start at 1000, clear of special tokens, where the vocabulary is that large."""
    rng = random.Random(seed)
    first = min(1000, config.vocab_size // 2)
    return [[rng.randrange(first, config.vocab_size - 1) for _ in range(rng.randint(lo, hi))] for _ in range(requests)]


def cuda_ms(fn, iters: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def ceilings() -> dict:
    """Measured bf16 matmul FLOP/s and copy bytes/s (read + write) on this device."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 2 * n**3 / (cuda_ms(lambda: a @ b) / 1e3)
    src = torch.randn(GiB // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 2 / (cuda_ms(lambda: dst.copy_(src)) / 1e3)
    return {"matmul_flops": flops, "copy_bytes_per_s": bandwidth}


def model_sizes(c: ModelConfig) -> tuple[int, int, int]:
    """(the layers' matmul parameters, bf16 bytes of the weights a decode step reads, bf16 KV bytes a token)."""
    h, kv, q = c.hidden_size, c.num_kv_heads * c.head_dim, c.num_heads * c.head_dim
    matmul_params = c.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size)
    return matmul_params, 2 * (matmul_params + h * c.vocab_size), 2 * c.num_layers * kv * 2


def floor_seconds(c: ModelConfig, prompts: list[list[int]], output: int, ceil: dict) -> dict:
    """Prefill matmul + attention FLOPs over the matmul rate; per decode step, weights + KV read over
    the copy bandwidth."""
    h, q = c.hidden_size, c.num_heads * c.head_dim
    matmul_params, weight_bytes, kv_token = model_sizes(c)
    lengths = [len(p) for p in prompts]
    prefill = sum(2 * n * matmul_params + 2 * n * n * q * c.num_layers + 2 * h * c.vocab_size for n in lengths)
    decode_bytes = sum(weight_bytes + kv_token * sum(n + t for n in lengths) for t in range(output))
    p, d = prefill / ceil["matmul_flops"], decode_bytes / ceil["copy_bytes_per_s"]
    return {"prefill_flops": prefill, "decode_bytes": decode_bytes, "prefill_s": p, "decode_s": d, "total_s": p + d}


def hf_peer(config: ModelConfig, prompts, output: int):
    """HF transformers continuous batching (paged|sdpa); returns its numbers and its state dict."""
    import transformers

    # RoPE scaling is left out: its config keys differ across transformers versions and it changes no cost.
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    model.set_attn_implementation("paged|sdpa")
    gen = transformers.GenerationConfig(max_new_tokens=output, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts[:4], generation_config=gen)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    out_tokens = sum(len(r.generated_tokens) for r in results.values())
    numbers = {"wall_s": wall, "output_tokens": out_tokens, "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
               "version": transformers.__version__}
    state = {k: v for k, v in model.state_dict().items()}
    del model, results
    return numbers, state


def run_engine(model, run: str, prompts, output: int, kv_memory: int, batched_tokens: int, warmup_tokens: int = 512,
               **options) -> dict:
    """``run`` is a KV layout, ``layout:attention`` for another backend than the layout's default, and
    ``...@ray`` for the Ray engine (a scheduler actor over worker actors; ``model`` a preset name), with
    ``/tpN`` and ``/ppN`` for tensor and pipeline parallelism (``mega@ray/tp2``); ``/sync`` and ``/async``
    turn async scheduling off or on (default: the engine's), ``/eager`` CUDA graphs off, ``/graphs`` on, ``/nccl``
    every TP sum on NCCL, none through peer memory (``disable_custom_all_reduce=True``), ``/overlap`` prefill
    products of 2048 rows or more in halves whose sums overlap (``tp_overlap_rows=2048``), ``/mbN`` N
    micro-batches in flight with pipeline stages (``pipeline_micro_batches``), ``/p2p`` the stages' own hand-off
    (``pipeline_handoff="p2p"``), ``/ring`` with the last stage's tokens handed back to the first (``"ring"``, the
    default where it runs), ``/channel`` the compiled graph's channel (``"channel"``), ``/depthN`` N steps in flight
    with async scheduling (``async_depth``), ``/oneshot`` TP's small sums through torch's one-shot kernel, not our
    Lamport kernel (``VATTN_PEER_ALL_REDUCE=one_shot``, which the Ray workers take from this process), ``/wholehead``
    the LM head whole on every TP rank, not split by vocabulary (``VATTN_SPLIT_LM_HEAD=0``); ``#k`` names a repeat.
    The warm-up runs every prompt's first ``warmup_tokens``; ``options`` go to the engine as they are."""
    name = run.partition("#")[0]
    overlap = False if "/sync" in name else True if "/async" in name else None
    graphs = False if "/eager" in name else True if "/graphs" in name else None
    parallel = {"disable_custom_all_reduce": True} if "/nccl" in name else {}
    if "/overlap" in name:
        parallel["tp_overlap_rows"] = 2048
    for handoff in ("p2p", "ring", "channel"):
        if f"/{handoff}" in name:
            parallel["pipeline_handoff"] = handoff
    switches = ({"VATTN_PEER_ALL_REDUCE": "one_shot"} if "/oneshot" in name else {}) | (
        {"VATTN_SPLIT_LM_HEAD": "0"} if "/wholehead" in name else {})
    for mode in ("/sync", "/async", "/eager", "/graphs", "/nccl", "/overlap", "/p2p", "/ring", "/channel", "/oneshot",
                 "/wholehead"):
        name = name.replace(mode, "")
    if depth := re.search(r"/depth(\d+)", name):
        parallel["async_depth"] = int(depth[1])
        name = name.replace(depth[0], "")
    spec, _, where = name.partition("@")
    layout, _, attention = spec.partition(":")
    where, *dims = where.split("/")
    shape = {"tp": 1, "pp": 1} | {d[:2]: int(d[2:]) for d in dims}
    if "mb" in shape:
        parallel["pipeline_micro_batches"] = shape.pop("mb")
    max_len = max(map(len, prompts)) + output
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    engine = dict(kv_layout=layout, attention=attention or None, kv_memory=kv_memory, max_num_seqs=len(prompts),
                  max_model_len=max_len, max_num_batched_tokens=batched_tokens, device="cuda", dtype="bfloat16",
                  distributed=where or "local", tensor_parallel_size=shape["tp"], pipeline_parallel_size=shape["pp"],
                  async_scheduling=overlap, cuda_graphs=graphs, **parallel)
    begun = time.perf_counter()
    with switched_env(switches), LLM(model, **(engine | options)) as llm:
        startup = time.perf_counter() - begun  # weights, KV pool, the runner's warm-ups, the CUDA graphs' captures
        # Warm-up at full batch: prefill chunks of the real size and batch-wide decode steps, so that
        # allocator growth and kernel selection for these shapes stay out of the timing. Its pages stay
        # mapped (deferred reclamation), in both engines alike.
        llm.generate([p[:warmup_tokens] for p in prompts], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        llm.reset_prefix_cache()  # else the timed run finds the warm-up's prefixes cached (W1: 41% of its prompt tokens)
        before = llm.snapshot()
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        after = llm.snapshot()
    report.generated_tokens(outputs, output)
    worker = after.workers[0]
    decode_steps = after.num_decode_steps - before.num_decode_steps
    decode_s = after.decode_step_seconds - before.decode_step_seconds
    return {
        "wall_s": wall, "startup_s": startup, "steps": after.num_steps - before.num_steps, "decode_steps": decode_steps,
        "mean_decode_step_ms": 1e3 * decode_s / max(1, decode_steps),
        "mean_decode_worker_ms": 1e3 * (after.decode_busy_seconds - before.decode_busy_seconds) / max(1, decode_steps),
        "mean_step_ms": 1e3 * (after.step_seconds - before.step_seconds) / max(1, after.num_steps - before.num_steps),
        # steps with a prefill chunk (mixed ones too): W1's are mostly full 8192-token chunks
        "mean_prefill_step_ms": 1e3 * (after.step_seconds - before.step_seconds - decode_s)
                                / max(1, after.num_steps - before.num_steps - decode_steps),
        "peak_kv_bytes": worker.peak_mapped_bytes, "kv_pool_bytes": worker.pool_bytes,  # per worker
        "peak_kv_bytes_per_worker": [w.peak_mapped_bytes for w in after.workers],
        "peer_all_reduce": [w.peer_all_reduce for w in after.workers],
        "preemptions": after.num_preemptions - before.num_preemptions,
        "map_latency_p50_us": statistics.median(worker.map_latency_us) if worker.map_latency_us else 0.0,
        "stall_s": worker.stall_seconds - before.workers[0].stall_seconds,
        "maps": worker.maps - before.workers[0].maps, "unmaps": worker.unmaps - before.workers[0].unmaps,
        "worker_busy_s": worker.busy_seconds - before.workers[0].busy_seconds,
        # the first worker's steps on its device (CUDA events around each): the wall less this is the device idle
        "device_s": worker.device_seconds - before.workers[0].device_seconds,
        "engine_step_s": after.step_seconds - before.step_seconds,
    }


@contextlib.contextmanager
def switched_env(switches: dict[str, str]):
    """``switches`` in this process's environment for the ``with`` block, the environment as it was after."""
    before = {k: os.environ.get(k) for k in switches}
    os.environ.update(switches)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def in_process_peer(name: str) -> str:
    """``mega@ray/tp2#2`` -> ``mega#2``, ``mega@ray/sync`` -> ``mega/sync``: the in-process run of the same
    layout, scheduling and repeat."""
    base, _, repeat = name.partition("#")
    mode = next((m for m in ("/sync", "/async") if m in base), "")
    return base.partition("@")[0] + mode + (f"#{repeat}" if repeat else "")


def plot(rows: list[list], floor: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names, walls = [r[0] for r in rows], [r[1] for r in rows]
    ax.barh(names, walls, color=["tab:gray" if n.startswith("HF") else "tab:blue" for n in names])
    ax.axvline(floor, color="k", ls="--", lw=0.8, label=f"roofline floor {floor:.1f} s")
    ax.set_xlabel("wall time (s), lower is better")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # log minor labels overlap
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def workload_options(parser: argparse.ArgumentParser) -> None:
    """W1's shape as options (defaults: W1), for the benchmarks that run it."""
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=512)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--output", type=int, default=128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_options(parser)
    parser.add_argument("--layouts", nargs="+", default=["mega", "per_layer", "paged"],
                        help="KV layouts, each optionally as layout:attention (e.g. mega:flash_attn), and with @ray "
                             "for the Ray engine (needs --no-hf: its worker builds the preset's weights itself)")
    parser.add_argument("--kv-memory-gib", type=float, default=40)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=0, help="requests running at once (default: every one; "
                        "a server's setting to compare a served rate with)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    parser.add_argument("--name", help="results file name (default throughput_MODEL)")
    args = parser.parse_args()
    config = PRESETS[args.model]
    stem = args.name or f"throughput_{args.model}"
    prompts = random_prompts(config, args.requests, args.min_prompt, args.max_prompt, args.seed)
    in_tokens = sum(map(len, prompts))
    ceil = ceilings()
    floor = floor_seconds(config, prompts, args.output, ceil)
    results: dict = {"workload": {"requests": args.requests, "prompt_tokens": in_tokens, "output_tokens": args.requests * args.output,
                                  "seed": args.seed}, "ceilings": ceil, "floor": floor, "runs": {}}
    if any("@ray" in run for run in args.layouts) and not args.no_hf:
        parser.error("@ray runs build the preset's random weights in their worker: add --no-hf")
    if args.no_hf:
        model = args.model  # every run builds the preset's weights, identical for a given seed (0)
    else:
        results["runs"]["HF paged|sdpa"], state = hf_peer(config, prompts, args.output)
        model = empty_model(config, torch.bfloat16, "cuda")
        load_state_dict(model, state)
        del state
    gc.collect()
    torch.cuda.empty_cache()
    for layout in args.layouts:
        try:
            results["runs"][layout] = run_engine(model, layout, prompts, args.output, int(args.kv_memory_gib * GiB),
                                                 args.max_num_batched_tokens,
                                                 **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}))
        except Exception as exc:  # keep the other layouts' numbers; the failure is reported, not hidden
            traceback.print_exc()
            results.setdefault("failed", {})[layout] = repr(exc)
            print(f"{layout}: FAILED {exc!r}")
        gc.collect()
        torch.cuda.empty_cache()
    total = in_tokens + args.requests * args.output
    hf_wall = results["runs"].get("HF paged|sdpa", {}).get("wall_s")
    rows = []
    for name, r in results["runs"].items():
        rows.append([name, r["wall_s"], total / r["wall_s"], args.requests * args.output / r["wall_s"],
                     r.get("mean_decode_step_ms"), (r.get("peak_kv_bytes") or r.get("peak_gpu_bytes", 0)) / GiB,
                     hf_wall / r["wall_s"] if hf_wall else None, r["wall_s"] / floor["total_s"]])
    headers = ["run", "wall s", "total tok/s", "output tok/s", "decode step ms", "peak KV GiB (HF: all GPU)",
               "speed-up vs HF", "x floor"]
    print(f"{args.requests} requests, {in_tokens} prompt tokens, {args.output} output tokens each; "
          f"floor {floor['total_s']:.2f} s (prefill {floor['prefill_s']:.2f} + decode {floor['decode_s']:.2f}); "
          f"matmul {ceil['matmul_flops'] / 1e12:.0f} TFLOP/s, copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    runs = results["runs"]
    results["ray_vs_local"] = {
        f"{name} / {local}": {"wall": runs[name]["wall_s"] / runs[local]["wall_s"],
                              "decode_step": runs[name]["mean_decode_step_ms"] / runs[local]["mean_decode_step_ms"]}
        for name in runs if "@ray" in name and (local := in_process_peer(name)) in runs
    }
    for pair, r in results["ray_vs_local"].items():
        print(f"{pair}: wall {r['wall']:.3f}x, decode step {r['decode_step']:.3f}x")
    for name, r in runs.items():
        if "worker_busy_s" in r:
            print(f"{name}: steps {r['engine_step_s']:.3f} s, of which the worker executed {r['worker_busy_s']:.3f} s "
                  f"and its device ran {r['device_s']:.3f} s; "
                  f"decode step {r['mean_decode_step_ms']:.2f} ms, of which the worker {r['mean_decode_worker_ms']:.2f} ms; "
                  f"prefill step {r['mean_prefill_step_ms']:.1f} ms; mapping stall {r['stall_s']:.3f} s")
    report.write(stem, headers, rows, results, args.out)
    plot(rows, floor["total_s"], args.out / f"{stem}.png")


if __name__ == "__main__":
    main()
