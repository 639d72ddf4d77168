"""Presence, frequency and repetition penalties: every penalized sequence's token counts, kept on the device.

A sequence's output so far must change its next token's logits, and under async scheduling its last token is still
on the device when the next step is launched. So the counts live on the device and grow there: after each draw, one
scatter adds every penalized row's token (``record``), with no wait for the host. A sequence starts with the output
the scheduler knew when it was announced (a fork of an n > 1 request has its first token already) and the prompt
as a mask (for ``repetition_penalty``). vLLM's order: after logit bias and min-tokens, before temperature.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker import kernels
from worker.staging import to_device


class PenaltyState:
    """Token counts of the penalized sequences a sampling worker draws for: a row of ``[capacity, vocab]`` counts
    (outputs) and prompt flags per sequence, rows reused as sequences end, the table doubled when full."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._rows: dict[int, int] = {}  # seq_id -> its row
        self._free: list[int] = []
        self._counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, seq_id: int, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Start counting for ``seq_id``: its prompt's tokens flagged, its output so far counted."""
        if not self._free:
            self._grow()
        row = self._rows[seq_id] = self._free.pop()
        self._counts[row].zero_()
        self._prompt[row].zero_()
        if prompt_token_ids:
            self._prompt[row, to_device(torch.tensor(prompt_token_ids, dtype=torch.int64), self.device)] = True
        if output_token_ids:
            ids = to_device(torch.tensor(output_token_ids, dtype=torch.int64), self.device)
            self._counts[row].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)

    def forget(self, seq_id: int) -> None:
        if (row := self._rows.pop(seq_id, None)) is not None:
            self._free.append(row)

    def _grow(self) -> None:
        old = self._counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], prompt[:old] = self._counts, self._prompt
        self._counts, self._prompt = counts, prompt
        self._free.extend(range(new - 1, old - 1, -1))

    def apply(self, logits: torch.Tensor, rows: Sequence[int], seq_ids: Sequence[int],
              params: Sequence) -> torch.Tensor:
        """``logits`` ``[rows, vocab]`` with the penalties of ``params`` applied to ``rows`` (sequences ``seq_ids``):
        a positive logit of a token in the prompt or the output divided by ``repetition_penalty``, a negative one
        multiplied; then ``frequency_penalty`` times its count in the output and ``presence_penalty`` once if there
        at all subtracted. The batch in one pass (``kernels.penalize``); the same tensor where ``rows`` is empty."""
        if not rows:
            return logits
        at, penalties = [-1] * logits.shape[0], [(1.0, 0.0, 0.0)] * logits.shape[0]
        for row, seq_id, p in zip(rows, seq_ids, params, strict=True):
            at[row] = self._rows[seq_id]
            penalties[row] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        return kernels.penalize(logits, to_device(torch.tensor(at, dtype=torch.int64), logits.device),
                                to_device(torch.tensor(penalties, dtype=torch.float32), logits.device),
                                self._counts, self._prompt)

    def record(self, seq_ids: Sequence[int], tokens: torch.Tensor) -> None:
        """Count ``tokens`` (on the device, one per sequence of ``seq_ids``) into their sequences' outputs."""
        if not seq_ids:
            return
        at = to_device(torch.tensor([self._rows[s] for s in seq_ids], dtype=torch.int64), tokens.device)
        self._counts.index_put_((at, tokens.to(torch.int64)), torch.ones_like(at, dtype=torch.int32), accumulate=True)
