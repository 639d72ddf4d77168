"""Executors: where the workers run. The engine hands one ``StepInput`` to ``execute`` and gets the
sampled tokens and every worker's pool report back; it does not know whether that was a function call
(``LocalExecutor``) or a compiled Ray graph over actors (``cluster.ray_executor.RayExecutor``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from cluster.config import EnginePlan
from worker.messages import StepInput, WorkerReport
from worker.model import Transformer
from worker.sampling import SampledToken
from worker.worker import Worker


@dataclass(frozen=True)
class StepResult:
    sampled: dict[int, tuple[int, ...]]  # seq_id -> token ids drawn
    reports: tuple[WorkerReport, ...]  # one per worker, pp-major
    logprobs: dict[int, tuple[SampledToken, ...]] = field(default_factory=dict)  # for the sequences that asked


class Executor(Protocol):
    def execute(self, step: StepInput) -> StepResult: ...

    def rebuild(self) -> None:
        """Replace the workers with fresh ones (new caches, model loaded again)."""

    def close(self) -> None: ...


class LocalExecutor:
    """The one worker in this process: TP = PP = 1."""

    def __init__(self, plan: EnginePlan, model: Transformer | None = None):
        (config,) = plan.workers
        self._config, self._model = config, model
        self.worker = Worker(config, model)

    def execute(self, step: StepInput) -> StepResult:
        out = self.worker.execute(step)
        return StepResult(out.sampled, (self.worker.report(),), out.logprobs)

    def rebuild(self) -> None:
        self.worker.close()
        self.worker = Worker(self._config, self._model)

    def close(self) -> None:
        self.worker.close()
