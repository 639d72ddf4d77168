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

In a token ring (``pipeline_handoff="ring"``) the last stage also sends each step's drawn tokens back to the first,
over a group of their own (a communicator, and so a stream, apart from the hidden states': on one stream a stage's
send of step k's rows and its receive of step k-1's tokens would each wait for the other's counterpart). The first
stage receives them when it launches the step as many steps later as there are stages, whose placeholders take
them: the device waits for the last stage's draw, not the host for the scheduler's round trip.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from worker.messages import StepInput


class StageLink:
    """Global ranks of this TP rank's counterparts in the stages before and after (None: first / last stage)."""

    def __init__(self, prev: int | None, next: int | None, ring: int | None = None, stages: int = 1):
        self.prev = prev
        self.next = next
        # In a token ring: the first stage's counterpart in the last stage, or the last stage's in the first; and their
        # own group (set by the worker's actor once the groups exist: a group does not pickle)
        self.ring = ring
        self.ring_group = None
        self._stages = stages
        # The send in flight and its tensor (kept from reuse until the send is done)
        self._sending: tuple[dist.Work, torch.Tensor] | None = None
        self._device: torch.device | None = None
        # The first stage of a ring: steps launched with a batch, and those of them that draw tokens (their launch and
        # each drawing sequence's row), whose tokens are still to be received
        self._launches = 0
        self._expected: deque[tuple[int, dict[int, int]]] = deque()
        # The last stage of a ring: token sends not known to be done, with their tensors
        self._handing: list[tuple[dist.Work, torch.Tensor]] = []

    def __repr__(self) -> str:
        return f"StageLink(prev={self.prev}, next={self.next}, ring={self.ring})"

    @classmethod
    def between(cls, rank: int, tp_size: int, pp_size: int, ring: bool = False) -> "StageLink":
        """Ranks are pp-major: the same TP rank one stage away is ``tp_size`` ranks away. ``ring``: the first and the
        last stage's same TP ranks are linked too (``ring_pairs``)."""
        stage, last = rank // tp_size, pp_size - 1
        back = None
        if ring and last > 0:
            back = rank + last * tp_size if stage == 0 else rank - last * tp_size if stage == last else None
        return cls(rank - tp_size if stage > 0 else None, rank + tp_size if stage < last else None, back, pp_size)

    @property
    def takes_back(self) -> bool:
        """The first stage of a token ring: it receives the last stage's tokens (``take_back``)."""
        return self.ring is not None and self.prev is None

    @property
    def hands_back(self) -> bool:
        """The last stage of a token ring: it sends its drawn tokens to the first (``hand_back``)."""
        return self.ring is not None and self.next is None

    @staticmethod
    def ring_pairs(tp_size: int, pp_size: int) -> list[list[int]]:
        """The ranks of each token ring's group: TP rank t of the first stage and of the last (every rank creates
        every one of them, in this order)."""
        return [[t, (pp_size - 1) * tp_size + t] for t in range(tp_size)]

    def connect(self, device: torch.device) -> None:
        """Open the link to both neighbours: every stage calls it at once, when the workers are set up. NCCL creates a
        pair's communicator at their first point-to-point call and waits there for both. Left to the first step,
        a stage's send would wait for a receive that the next stage posts only once this stage's marker arrived,
        which comes after the send: both stages hung (2xH200, 2026-11-27)."""
        self._device = device
        token = torch.zeros(1, device=device)
        if self.prev is not None:  # the stage before first: a middle stage's send waits for nothing downstream
            dist.recv(token, self.prev)
        if self.next is not None:
            dist.send(token, self.next)
        if self.takes_back:  # after the hidden states' link, which the last stage needed the first's send for
            dist.recv(token, self.ring, group=self.ring_group)
        elif self.hands_back:
            dist.send(token, self.ring, group=self.ring_group)

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

    def take_back(self, step: StepInput) -> tuple[torch.Tensor, dict[int, int]] | None:
        """The first stage of a ring, for every step it is sent: the tokens the last stage drew in the step launched
        as many steps before this one as there are stages, ``(tokens, row of each sequence)``, received on the device
        (None where that step drew none). A step without a batch (the engine idle: every step's tokens sent) takes
        every token still to come, so that no send waits."""
        if not step.token_ids:
            self._receive_due(self._launches + self._stages)
            return None
        handed = self._receive_due(self._launches)
        drawing = [seq_id for seq_id, n in zip(step.seq_ids, step.num_samples) if n]
        if drawing:
            self._expected.append((self._launches, {seq_id: row for row, seq_id in enumerate(drawing)}))
        self._launches += 1
        return handed

    def _receive_due(self, launch: int) -> tuple[torch.Tensor, dict[int, int]] | None:
        """Receive the tokens of every step launched ``self._stages`` launches or more before ``launch``, in order;
        the last one's if it was launched exactly that many before."""
        handed = None
        while self._expected and self._expected[0][0] <= launch - self._stages:
            at, rows = self._expected.popleft()
            tokens = torch.empty(len(rows), dtype=torch.long, device=self._device)
            dist.recv(tokens, self.ring, group=self.ring_group)
            handed = (tokens, rows) if at == launch - self._stages else None
        return handed

    def hand_back(self, tokens: torch.Tensor) -> None:
        """The last stage of a ring: send a step's drawn tokens (a row per drawing sequence) to the first stage,
        queued behind the kernels that draw them, from a copy (the next step draws into the same buffer). Never
        waited for here: the first stage receives them a few steps later, when its host is on that step."""
        self._handing = [(work, t) for work, t in self._handing if not work.is_completed()]
        tokens = tokens.to(torch.long, copy=True)
        self._handing.append((dist.isend(tokens, self.ring, group=self.ring_group), tokens))

    def close(self) -> None:
        """Wait for the sends in flight and let go of them, and take every token still to come: before the process
        group they run in is destroyed."""
        self._wait()
        if self.takes_back:
            self._receive_due(self._launches + self._stages)
        for work, _ in self._handing:
            work.wait()
        self._handing = []

    def _wait(self) -> None:
        """Until the send in flight is done (with NCCL: the device's current stream waits for it)."""
        if self._sending is not None:
            work, _ = self._sending
            self._sending = None
            work.wait()
