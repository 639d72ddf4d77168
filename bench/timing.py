"""Timing GPU work: the median of CUDA-event timings, each call timed alone."""

from __future__ import annotations

import statistics

import torch


def time_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median GPU milliseconds of ``fn`` over ``iters`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
