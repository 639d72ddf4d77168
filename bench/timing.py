"""Timing GPU work: the median of CUDA-event timings, each call timed alone (``time_ms``), or calls queued back to
back as CUDA graphs replay them, so that no call's host-side work counts (``queued_ms``)."""

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


def queued_ms(fn, iters: int = 50) -> float:
    """GPU milliseconds a call of ``fn`` takes with ``iters`` calls in the stream's queue."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
