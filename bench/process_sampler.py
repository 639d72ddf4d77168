"""Where a server's processes spend their CPU while a client drives it: py-spy samples of each process whose command
line matches a pattern (collapsed stacks, one file per process), and every thread's CPU seconds over the same span
from /proc (a step loop near one core's worth, or several threads that together are, is a GIL-bound process).

    sampler = ProcessSampler({"scheduler": "ray::SchedulerActor", "ingress": "VattnIngress"}, out_dir)
    sampler.start(); <drive the server>; summary = sampler.stop()
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Where ``tools/gpu_chain.sh`` installs py-spy on the GPU machine; else the one on PATH.
PY_SPY = "/tmp/pyspy/bin/py-spy"


def _pids(pattern: str) -> list[int]:
    done = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split() if int(p) != os.getpid()]


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each of ``pid``'s threads, by "name/tid"."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


@dataclass
class ProcessSampler:
    """``patterns``: label -> a pattern ``pgrep -f`` finds the process by (its first match); the first label's process
    is the one whose load marks the span measured. ``out_dir``: where the stacks go (``<label>.txt``, py-spy's raw
    format: one ``stack count`` line per distinct stack)."""

    patterns: dict[str, str]
    out_dir: Path
    rate: int = 100
    period_s: float = 0.5
    _spies: dict[str, subprocess.Popen] = field(default_factory=dict)
    _pids: dict[str, int] = field(default_factory=dict)
    _series: list[tuple[float, dict[str, dict[str, float]]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        spy = PY_SPY if os.path.exists(PY_SPY) else shutil.which("py-spy")
        for label, pattern in self.patterns.items():
            pids = _pids(pattern)
            if not pids:
                print(f"process sampler: no process matches {pattern!r} ({label})", flush=True)
                continue
            self._pids[label] = pids[0]
            if spy is not None:  # --nonblocking: a sample must not pause the process it measures
                self._spies[label] = subprocess.Popen(
                    [spy, "record", "--pid", str(pids[0]), "--rate", str(self.rate), "--format", "raw", "--nonblocking", "--threads",
                     "--output", str(self.out_dir / f"{label}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            snapshot = {}
            for label, pid in self._pids.items():
                try:
                    snapshot[label] = _thread_cpu(pid)
                except OSError:  # the process ended
                    pass
            self._series.append((time.monotonic(), snapshot))
            if self._stop.wait(self.period_s):
                return

    def stop(self) -> dict:
        """Stop sampling; per label, over the span the first label's process was busy (at least a quarter of a core;
        the client's start-up is not in it): the pid, the span, each busy thread's CPU share, the process's in all."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for spy in self._spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        for spy in self._spies.values():
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        if not self._pids or len(self._series) < 2:
            return {}
        first = next(iter(self._pids))
        busy = [(a, b) for a, b in zip(self._series, self._series[1:])
                if first in a[1] and first in b[1] and _share(a, b, first) >= 0.25]
        span = sum(b[0] - a[0] for a, b in busy)
        summary = {}
        for label, pid in self._pids.items():
            threads: dict[str, float] = {}
            for a, b in busy:
                for t, seconds in b[1].get(label, {}).items():
                    threads[t] = threads.get(t, 0.0) + seconds - a[1].get(label, {}).get(t, seconds)
            shares = {t: s / span for t, s in threads.items()} if span else {}
            summary[label] = {"pid": pid, "busy_span_s": round(span, 2), "cpu_share": round(sum(shares.values()), 3),
                              "threads": {t: round(s, 3) for t, s in sorted(shares.items(), key=lambda x: -x[1])
                                          if s >= 0.02}}
        return summary


def _share(a: tuple[float, dict], b: tuple[float, dict], label: str) -> float:
    """``label``'s process's CPU share between two snapshots (threads that ended between them count nothing)."""
    before, after = a[1][label], b[1][label]
    return sum(s - before.get(t, s) for t, s in after.items()) / (b[0] - a[0])
