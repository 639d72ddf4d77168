"""``StageLink``: a pipeline stage's own hand-off of hidden states to the next stage (``pipeline_handoff="p2p"``).

Through the compiled graph's channel (``"channel"``) a later stage's task starts only once the hidden states are
there: Ray's NCCL receive waits for the device before it returns. Here the workers send and receive them
themselves, over torch.distributed between the same TP rank of neighbouring stages, and the compiled graph
carries only a small marker from one stage to the next (so a stage's error still reaches the next one, which then
receives nothing). The receive is queued before the stage applies its step's KV operations and plans it: with NCCL
both calls only queue work, so that host work overlaps the stage before's compute and the device waits for the
rows. With gloo (CPU) the receive blocks, which changes nothing but the timing. A send is waited for at the next
one: with gloo a blocking send would wait for the next stage's receive, which comes only after this stage's marker.
The link is opened when the workers are set up (``connect``), not by the first step's send: NCCL creates a pair's
communicator at their first send or receive, and both must be there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from worker.messages import StepInput


class StageLink:
    """Global ranks of this TP rank's counterparts in the stages before and after (None: first / last stage)."""

    def __init__(self, prev: int | None, next: int | None):
        self.prev = prev
        self.next = next
        # The send in flight and its tensor (kept from reuse until the send is done)
        self._sending: tuple[dist.Work, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"StageLink(prev={self.prev}, next={self.next})"

    @classmethod
    def between(cls, rank: int, tp_size: int, pp_size: int) -> "StageLink":
        """Ranks are pp-major: the same TP rank one stage away is ``tp_size`` ranks away."""
        stage = rank // tp_size
        return cls(rank - tp_size if stage > 0 else None, rank + tp_size if stage < pp_size - 1 else None)

    def connect(self, device: torch.device) -> None:
        """Open the link to both neighbours: every stage calls it at once, when the workers are set up. NCCL creates a
        pair's communicator at their first point-to-point call and waits there for both. Left to the first step,
        a stage's send would wait for a receive that the next stage posts only once this stage's marker arrived,
        which comes after the send: both stages hung (2xH200, 2026-11-27)."""
        token = torch.zeros(1, device=device)
        if self.prev is not None:  # the stage before first: a middle stage's send waits for nothing downstream
            dist.recv(token, self.prev)
        if self.next is not None:
            dist.send(token, self.next)

    def receive(self, step: StepInput, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The stage before's hidden states for ``step``: a row per token of the step (None on the first stage, and
        for a step without a batch, for which nothing was sent)."""
        rows = len(step.token_ids)
        if self.prev is None or not rows:
            return None
        hidden = torch.empty(rows, width, dtype=dtype, device=device)
        dist.recv(hidden, self.prev)
        return hidden

    def send(self, step: StepInput, hidden: torch.Tensor | None) -> int:
        """Send ``step``'s hidden states on (queued behind the kernels that compute them) once the previous send is
        done; the rows sent, which the compiled graph carries to the next stage as its marker."""
        if hidden is None:
            return 0
        if hidden.shape[0] != len(step.token_ids):  # the next stage receives a row per token: it would hang or misread
            raise ValueError(f"step {step.step}: {hidden.shape[0]} rows of hidden states for {len(step.token_ids)} tokens")
        self._wait()
        hidden = hidden.contiguous()
        self._sending = (dist.isend(hidden, self.next), hidden)
        return hidden.shape[0]

    def close(self) -> None:
        """Wait for the send in flight and let go of it: before the process group it runs in is destroyed."""
        self._wait()

    def _wait(self) -> None:
        """Until the send in flight is done (with NCCL: the device's current stream waits for it)."""
        if self._sending is not None:
            work, _ = self._sending
            self._sending = None
            work.wait()
