"""The sampler's cost per step on the device: the batched draw (``worker.sampling.sample``) against the row-by-row
draw it replaced and against greedy argmax (the floor), at the batch sizes of a decode step; and the draw's kernel
alone, each row's vocabulary cut into parts (now) against one program a row (before).

    python bench/sampling.py [--rows 1 16 64 256] [--vocab 128256]

Each variant samples the same logits (``--dtype``, the model's by default); the variants take turns within every
iteration (so drift hits all alike), timed by CUDA events around each on the device alone (``time_ms``), median of
``--iters``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
from worker import kernels  # noqa: E402
from worker.sampling import SamplingParams, noise_keys, sample  # noqa: E402


def row_by_row(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> torch.Tensor:
    """The sampler before the batched one (kept here as the baseline): per row a generator, a softmax and an
    exponential draw, ~8 launches each."""
    out = []
    for row, (p, seed) in enumerate(zip(params, seeds)):
        scaled = logits[row] / p.temperature
        probs = scaled.softmax(-1)
        q = torch.empty_like(probs).exponential_(1, generator=torch.Generator(device=logits.device).manual_seed(seed))
        out.append((probs / q).argmax())
    return torch.stack(out)


def time_ms(fn, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    """The device's time for ``fn``'s kernels: a spin kernel ahead of them holds the device while the host queues
    them (as the engine queues a step's draw while the step runs), so the host's launch time is not counted."""
    torch.cuda._sleep(20_000_000)  # ~10 ms: longer than queuing any variant
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16", help="the logits' (the engine draws from the model's dtype)")
    parser.add_argument("--name", default="sampling_h100")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a CUDA device times the sampler"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows_out, raw = [], {}
    for rows in args.rows:
        logits = (4 * torch.randn(rows, args.vocab, device="cuda")).to(getattr(torch, args.dtype))
        plain = [SamplingParams(temperature=0.8)] * rows
        masked = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * rows
        keys = [noise_keys(r, 0, 1) for r in range(rows)]
        temperature = torch.full((rows,), 0.8, device="cuda")
        key_words = torch.tensor(keys, dtype=torch.int64, device="cuda")
        variants = {
            "greedy argmax": lambda: logits.argmax(-1),
            "draw kernel, parts": lambda: kernels.gumbel_argmax(logits, temperature, key_words),
            "draw kernel, a program a row (before)": lambda: kernels.gumbel_argmax(logits, temperature, key_words,
                                                                                  parts=1),
            "batched": lambda: sample(logits, plain, keys),
            "batched top-k/top-p": lambda: sample(logits, masked, keys),
            "row by row (before)": lambda: row_by_row(logits, plain, list(range(rows))),
        }
        times = {name: [] for name in variants}
        for _ in range(5):  # warm-up: Triton compiles, the allocator fills
            for fn in variants.values():
                fn()
        torch.cuda.synchronize()
        for i in range(args.iters):
            order = list(variants) if i % 2 == 0 else list(variants)[::-1]
            for name in order:
                times[name].append(time_ms(variants[name], start, end))
        raw[rows] = times
        rows_out.append([rows, *(statistics.median(times[name]) for name in variants)])
        headers = ["rows", *(f"{name} ms" for name in variants)]
    report.write(args.name, headers, rows_out, {"vocab": args.vocab, "dtype": args.dtype, "iters": args.iters, "raw_ms": raw}, args.out)


if __name__ == "__main__":
    main()
