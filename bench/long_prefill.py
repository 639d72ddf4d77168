"""Long-context prefill, the vAttention paper's prefill figure: the time to prefill one prompt of 8K to 128K tokens
(the request's time to first token), chunked (``--chunk`` tokens a step) and unchunked (the whole prompt in one
step), on each KV layout / attention backend, side by side in one process.

    python bench/long_prefill.py [--model llama-3.1-8b] [--lengths 8192 16384 32768 65536 131072]
                                 [--runs mega paged] [--chunk 8192]

``--runs`` entries are ``layout`` or ``layout:attention`` (``mega:flash_attn``); the first is the baseline of the
ratios. Random weights (the preset's shape); each length is measured after a warm-up prefill of the same
length, so that allocator growth and kernel selection stay out of it. ``--device cpu --model tiny`` is a smoke run.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import report  # noqa: E402
from cluster.engine import LLM  # noqa: E402
from worker.config import PRESETS  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prefill_seconds(run: str, model: str, lengths: list[int], chunk: int | None, device: str, kv_memory: int) -> list[float]:
    """Seconds to the first token of one prompt of each length less one (so that with that token it fills the
    length: 131072 is Llama 3.1's whole context); the longest sets the batch budget unless ``chunk`` is given."""
    layout, _, attention = run.partition(":")
    longest = max(lengths)
    rng = random.Random(0)
    vocab = PRESETS[model].vocab_size
    out = []
    with LLM(model, kv_layout=layout, attention=attention or None, kv_memory=kv_memory, device=device,
             dtype="bfloat16" if device == "cuda" else "float32", max_num_seqs=1, max_model_len=longest,
             max_num_batched_tokens=chunk or longest, cuda_graphs=False) as llm:
        for n in lengths:
            prompt = [rng.randrange(3, vocab - 1) for _ in range(n - 1)]  # with its first token: n of context
            llm.generate([prompt], FIRST_TOKEN)  # warm-up at this length
            llm.reset_prefix_cache()  # else the timed prefill finds this very prompt cached
            sync(device)
            start = time.perf_counter()
            llm.generate([prompt], FIRST_TOKEN)
            sync(device)
            out.append(time.perf_counter() - start)
            print(f"{run} {'chunked' if chunk else 'unchunked'} {n}: {out[-1]:.3f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--runs", nargs="+", default=["mega", "paged"])
    parser.add_argument("--chunk", type=int, default=8192, help="tokens a step when chunked")
    parser.add_argument("--modes", nargs="+", default=["chunked", "unchunked"], choices=["chunked", "unchunked"])
    parser.add_argument("--kv-memory-gib", type=float, default=24)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--name", default="long_prefill")
    args = parser.parse_args()
    seconds: dict[str, dict[str, list[float]]] = {}
    for mode in args.modes:
        for run in args.runs:
            chunk = args.chunk if mode == "chunked" else None
            seconds.setdefault(mode, {})[run] = prefill_seconds(run, args.model, args.lengths, chunk, args.device,
                                                                int(args.kv_memory_gib * (1 << 30)))
    base = args.runs[0]
    rows = [[mode, run, n, t, seconds[mode][base][i] / t] for mode in seconds for run in seconds[mode]
            for i, (n, t) in enumerate(zip(args.lengths, seconds[mode][run]))]
    report.write(args.name, ["mode", "run", "prompt tokens", "prefill s", f"{base} s / this"], rows,
                 {"model": args.model, "lengths": args.lengths, "chunk": args.chunk, "seconds": seconds})
    fig, axes = plt.subplots(1, len(seconds), figsize=(6 * len(seconds), 4), squeeze=False)
    for ax, (mode, runs) in zip(axes[0], seconds.items()):
        for run, times in runs.items():
            ax.plot(args.lengths, times, marker="o", label=run)
        ax.set(title=f"{args.model}, prefill of one prompt, {mode}", xlabel="prompt tokens", ylabel="seconds",
               xscale="log", yscale="log")
        ax.set_xticks(args.lengths, [f"{n // 1024}K" for n in args.lengths])
        ax.legend()
    fig.tight_layout()
    fig.savefig(Path(report.RESULTS) / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
