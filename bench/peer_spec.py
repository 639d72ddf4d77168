"""What both sides of ``bench/peer.py`` agree on: the run spec they read, the result they write, and the check
that refuses to compare results that did not come from the same call and the same prompts.

Standard library only: the vLLM side (``peer_vllm.py``) imports this from vLLM's own environment.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


class PeerMismatch(ValueError):
    """Two results that must not be compared: different calls, devices, workloads or prompts."""


def digest(prompts: list[list[int]], output: int, followups: list[list[list[int]]] | None = None) -> str:
    """A workload's identity: its token ids (and later turns' messages) and output length (sha256, 16 hex digits)."""
    what = [prompts, output] + ([followups] if followups else [])
    return hashlib.sha256(json.dumps(what, separators=(",", ":")).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class WorkloadRun:
    """One workload a side runs: prompts in ``prompts_file`` (a JSON list of token-id lists)."""

    name: str
    prompts_file: str
    output: int
    # Driven one engine step at a time, counting the requests that gained a token in each step: how many run
    # at once (the memory-bound workload). Otherwise one ``generate`` call.
    stepwise: bool = False
    # A conversation per prompt: after each turn, the next turn's prompt is the last prompt, the engine's own answer
    # and the next message of ``followups_file`` (a JSON list, per later turn, of one message per conversation).
    followups_file: str | None = None

    def prompts(self) -> list[list[int]]:
        return json.loads(Path(self.prompts_file).read_text())

    def followups(self) -> list[list[list[int]]]:
        return json.loads(Path(self.followups_file).read_text()) if self.followups_file else []


@dataclass(frozen=True)
class SideSpec:
    """What one engine process runs: a warm-up, then ``reps`` rounds over ``workloads`` (cold prefix cache each),
    then, with ``profile_dir``, one profiled run of ``profile`` (its first ``profile_tokens`` outputs)."""

    call_id: str
    engine: str  # "vattn" or "vllm"
    label: str  # the run's name in the results, e.g. "vllm-defaults"
    model: str  # vattn: a preset; vLLM: a model directory with config.json
    engine_args: dict
    workloads: list[WorkloadRun]
    warmup_prompts: int = 128
    warmup_tokens: int = 512
    reps: int = 2
    profile: str | None = None  # a workload name
    profile_dir: str | None = None
    profile_tokens: int = 32

    @classmethod
    def read(cls, path: str | Path) -> "SideSpec":
        raw = json.loads(Path(path).read_text())
        raw["workloads"] = [WorkloadRun(**w) for w in raw["workloads"]]
        return cls(**raw)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))


@dataclass
class SideResult:
    """What one engine process measured. ``runs``: per round, per workload, wall seconds and tokens."""

    call_id: str
    engine: str
    label: str
    device: str
    versions: dict
    engine_args: dict  # as resolved by the engine, not only as asked
    digests: dict[str, str] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)  # {"workload", "round", "wall_s", "output_tokens", ...}
    start_s: float = 0.0  # engine construction, seconds
    profile_trace: str | None = None  # the first worker's (TP rank 0 of the first stage)
    profile_traces: list[str] = field(default_factory=list)  # every worker's, in rank order

    def record(self, workload: str, prompts: list[list[int]], output: int, round_: int, wall_s: float,
               output_tokens: int, followups: list[list[list[int]]] | None = None, **extra) -> None:
        expected = len(prompts) * output * (1 + len(followups or []))
        if output_tokens != expected:  # ignore_eos: every request must run to max_tokens
            raise RuntimeError(f"{self.label}: {workload} produced {output_tokens} output tokens, expected {expected}")
        self.digests[workload] = digest(prompts, output, followups)
        self.runs.append({"workload": workload, "round": round_, "wall_s": wall_s, "output_tokens": output_tokens,
                          **extra})

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, path: str | Path) -> "SideResult":
        return cls(**json.loads(Path(path).read_text()))


def steady_running(counts: list[int]) -> int:
    """Requests running at once in steady state: the median of the per-step counts over the middle half of the
    steps (ramp-up and drain left out)."""
    middle = sorted(counts[len(counts) // 4: 3 * len(counts) // 4]) or sorted(counts)
    return middle[len(middle) // 2]


def check_comparable(results: list[SideResult]) -> None:
    """Raise ``PeerMismatch``, naming what differs, unless every result comes from one call on one device and
    ran the same prompts for every workload they share."""
    if len(results) < 2:
        raise PeerMismatch(f"a comparison needs two results or more, got {len(results)}")
    first = results[0]
    for r in results[1:]:
        if r.call_id != first.call_id:
            raise PeerMismatch(f"{r.label} comes from call {r.call_id}, {first.label} from call {first.call_id}: "
                               "numbers from different calls are not compared; rerun both sides in one call")
        if r.device != first.device:
            raise PeerMismatch(f"{r.label} ran on {r.device!r}, {first.label} on {first.device!r}")
        for name in sorted(set(r.digests) & set(first.digests)):
            if r.digests[name] != first.digests[name]:
                raise PeerMismatch(f"workload {name}: {r.label} ran prompts {r.digests[name]}, {first.label} ran "
                                   f"{first.digests[name]}: not the same prompts")
