"""``StepProfiler``: torch profiler traces of the steps one worker runs (``LLM.start_profile`` / ``stop_profile``,
vLLM's calls), with every step in a range named after what it runs, so that ``bench/trace_breakdown.py`` splits a
trace into prefill and decode steps, kernel by kernel.

A Ray worker runs its steps on the compiled graph's thread and answers other calls on another, so the profiler
records every thread of the process (``profile_all_threads``), and starts and stops on a thread of its own: Kineto
wants both on one thread, which Ray's thread pool does not promise. (Kineto initializes on the thread of the first
profile in the process and says once, on stderr, that it is not the thread which imported torch: harmless, the
trace is whole.)
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile, record_function

from worker.messages import StepInput


def step_name(step: StepInput) -> str:
    """``vattn_step_prefill(P)_decode(D)_seqs(S)``: P tokens of chunks longer than one or drawing nothing (prompt
    chunks), D of one-token chunks that draw (decoding sequences), S chunks."""
    lengths = [b - a for a, b in zip(step.offsets, step.offsets[1:])]
    decode = sum(1 for n, k in zip(lengths, step.num_samples) if n == 1 and k)
    return f"vattn_step_prefill({sum(lengths) - decode})_decode({decode})_seqs({len(lengths)})"


class StepProfiler:
    """One worker's profiler: off until ``start``, which ``stop`` ends by writing the trace."""

    def __init__(self, device: torch.device | None = None) -> None:
        # The worker's device, made current on the profiler's thread: stopping synchronizes the current device,
        # which on a new thread is device 0 -- another rank's GPU where a worker sees its peers'.
        self._device = device if device is not None and device.type == "cuda" else None
        self._profile: profile | None = None
        self._path: Path | None = None
        self._thread: ThreadPoolExecutor | None = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, path: str | Path) -> None:
        """Record from now on; ``stop`` writes the Chrome trace (gzipped where the name ends in ``.gz``) to
        ``path``, creating its directory."""
        if self._profile is not None:
            raise RuntimeError(f"the profiler is already recording (to {self._path}): stop it first")
        select = (lambda: torch.cuda.set_device(self._device)) if self._device is not None else None
        thread = ThreadPoolExecutor(1, thread_name_prefix="vattn-profiler", initializer=select)
        try:
            prof = thread.submit(_started).result()
        except BaseException:
            thread.shutdown()
            raise
        self._profile, self._path, self._thread = prof, Path(path), thread

    def stop(self) -> Path:
        """Stop recording and write the trace; its path. Between steps (the engine calls it so): a step launching
        meanwhile would lose its range."""
        if self._profile is None:
            raise RuntimeError("the profiler is not recording: start_profile() first")
        prof, path, thread = self._profile, self._path, self._thread
        self._profile = self._path = self._thread = None
        try:
            thread.submit(prof.__exit__, None, None, None).result()
        finally:
            thread.shutdown()
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        return path

    def step(self, step: StepInput):
        """A range around ``step``'s launch while recording; nothing otherwise (one attribute check)."""
        return self._range(step_name, step)

    def phase(self, name: str):
        """A range ``vattn_phase_<name>`` around a part of a step's launch while recording (the host work between
        the kernels' launches, which the trace shows as no op at all otherwise); nothing otherwise."""
        return self._range("vattn_phase_{}".format, name)

    def _range(self, named, what):
        """``record_function(named(what))`` while recording; the name is made only then."""
        return contextlib.nullcontext() if self._profile is None else record_function(named(what))


def _started() -> profile:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True))
    prof.__enter__()
    return prof
