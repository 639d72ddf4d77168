"""Executors: where the workers run. The engine submits one ``StepInput`` at a time and later takes the
sampled tokens and every worker's pool report from the handle; it does not know whether that was a
function call (``LocalExecutor``) or a compiled Ray graph over actors (``cluster.ray_executor.RayExecutor``).
Steps run in the order submitted, so a second may be submitted before the first's result is taken."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from cluster.config import EnginePlan
from worker.messages import StepInput, WorkerReport
from worker.model import Transformer
from worker.sampling import SampledToken
from worker.worker import PendingOutput, Worker


@dataclass(frozen=True)
class StepResult:
    sampled: dict[int, tuple[int, ...]]  # seq_id -> token ids drawn
    reports: tuple[WorkerReport, ...]  # one per worker, pp-major
    logprobs: dict[int, tuple[SampledToken, ...]] = field(default_factory=dict)  # for the sequences that asked
    # seq_id -> (the position of its first entry, its prompt tokens' logprobs computed this step)
    prompt_logprobs: dict[int, tuple[int, tuple[SampledToken, ...]]] = field(default_factory=dict)


class PendingStep(Protocol):
    def result(self) -> StepResult:
        """Wait for the step; raises what running it raised."""

    def supply_masks(self, masks: dict[int, bytes | None]) -> None:
        """The grammar masks of the step's ``late_masks`` sequences (an executor with ``late_masks``)."""


class Executor(Protocol):
    plan: EnginePlan  # sized: every worker's pool known

    def submit(self, step: StepInput) -> PendingStep: ...

    def execute(self, step: StepInput) -> StepResult:
        """``submit(step).result()``."""

    def rebuild(self) -> None:
        """Replace the workers with fresh ones (new caches, model loaded again)."""

    def start_profile(self, directory: str) -> None:
        """Every worker records its steps under torch's profiler (``Worker.start_profile``)."""

    def stop_profile(self) -> list[str]:
        """Every worker's trace, pp-major."""

    def close(self) -> None: ...


class LocalExecutor:
    """The one worker in this process: TP = PP = 1. ``submit`` queues the step's kernels and returns; its
    result is read when asked for. With async scheduling the engine submits step k+1 before it reads step k,
    so the device runs step k+1 right after step k while this thread takes step k's tokens and schedules. Grammar
    masks may follow a launch (``late_masks``): the forward pass is queued at once, the draw when they come."""

    late_masks = True

    def __init__(self, plan: EnginePlan, model: Transformer | None = None):
        """``plan.is_sized`` is False where the pool is a fraction of the free memory: ``self.plan`` is sized
        once the weights are in."""
        self.worker = Worker(plan.workers[0], model)
        try:
            if not plan.is_sized:
                c = plan.config
                plan = plan.sized([self.worker.kv_memory_available(c.kv_memory_fraction, 1, c.gpu_memory_utilization)])
                self.worker.allocate(plan.workers[0].pool_bytes)
        except BaseException:
            self.worker.close()
            raise
        self.plan = plan
        self._config, self._model = plan.workers[0], model

    def submit(self, step: StepInput) -> "LocalPending":
        return LocalPending(self.worker, self.worker.launch(step))

    def execute(self, step: StepInput) -> StepResult:
        return self.submit(step).result()

    def rebuild(self) -> None:
        self.worker.close()
        self.worker = Worker(self._config, self._model)

    def start_profile(self, directory: str) -> None:
        self.worker.start_profile(directory)

    def stop_profile(self) -> list[str]:
        return [self.worker.stop_profile()]

    def close(self) -> None:
        self.worker.close()


@dataclass
class LocalPending:
    """A step the local worker launched; ``result`` waits for it (once)."""

    worker: Worker
    pending: PendingOutput
    _result: StepResult | None = None

    def supply_masks(self, masks: dict[int, bytes | None]) -> None:
        self.pending = self.worker.supply_masks(self.pending, masks)

    def result(self) -> StepResult:
        if self._result is None:
            out = self.worker.finish(self.pending)
            self._result = StepResult(out.sampled, (self.worker.report(),), out.logprobs, out.prompt_logprobs)
        return self._result
