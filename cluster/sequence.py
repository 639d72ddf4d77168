"""Requests and their sequences: what the scheduler tracks between steps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from worker.sampling import SampledToken, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class Timestamps:
    """Per-request times (``time.monotonic``) for latency metrics."""

    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share cached blocks
    grammar: str | None = None  # structured outputs: the compiled grammar its sequences' outputs must match
    bad_words: tuple[tuple[int, ...], ...] = ()  # ``params.bad_words`` as token ids, each way they can be written
    times: Timestamps = field(default_factory=Timestamps)
    seqs: list["Sequence"] = field(default_factory=list)
    # ``params.prompt_logprobs``: the logprob of prompt token i + 1 given those before it, at i (as computed so far)
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    prompt_token_texts: dict[int, str] = field(default_factory=dict)  # of the ids its prompt logprobs name

    released: bool = False  # ``release`` was called: its sequences are let go of

    @property
    def finished(self) -> bool:
        return self.released or (len(self.seqs) == self.params.n and all(s.status is SeqStatus.FINISHED for s in self.seqs))

    def release(self) -> None:
        """Let go of its sequences, once its final output is built. A request and its sequences reference each other:
        a cycle, which reference counting never frees. Every finished request waited for the cyclic collector, whose
        collections of the oldest generation then walked all of them with the step loop standing still: a closed loop
        of 256 clients over the scheduler alone (``bench/scheduler_serving.py``, CPU box) paused 70 ms in one."""
        self.seqs = []
        self.released = True

    def waits_for_its_last_token(self, late_masks: bool) -> bool:
        """Its next draw depends on the token before it (a grammar, a bad word of several tokens): under async
        scheduling it skips the step launched while that token is on the device -- except for a grammar where the
        executor takes its mask after the launch (``late_masks``: the draw waits for it, not the forward pass)."""
        return (self.grammar is not None and not late_masks) or any(len(w) > 1 for w in self.bad_words)


@dataclass(eq=False)
class Sequence:
    """One output stream of a request. ``num_computed`` tokens of ``token_ids`` have K/V in the cache
    once the steps scheduled so far have run (it advances when a step is scheduled); recompute after
    preemption just sets it back to 0 (vLLM v1's catch-up model). ``pending`` tokens are being sampled
    by steps in flight: the sequence is ``num_tokens`` long though ``token_ids`` does not hold them yet."""

    seq_id: int
    request: Request
    sample_index: int
    token_ids: list[int]
    num_computed: int = 0
    slot: int | None = None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[SampledToken] = field(default_factory=list)
    token_texts: dict[int, str] = field(default_factory=dict)  # the text of each token ``logprobs[:texts_for]`` names
    texts_for: int = 0
    num_preemptions: int = 0
    pending: int = 0
    scheduled_round: int = -1  # the scheduler's step (``Scheduler.rounds``) that last took it
    # The output's text so far, decoded a token at a time (``EngineCore._text``), and the exact text once finished.
    text: str = ""
    decoded: int = 0  # output tokens in ``text``
    detokenizer: object | None = None
    final_text: str | None = None
    # Prefix caching: the hashes of the cache pages ``token_ids`` fill so far, and how many of the first pages the
    # ledger indexed (or found indexed) for this sequence.
    page_hashes: list[bytes] = field(default_factory=list)
    num_cached_pages: int = 0
    # Structured outputs (``cluster.structured``): the grammar's matcher, and how many output tokens it consumed.
    matcher: object | None = None
    matched: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.pending

    @property
    def num_generated(self) -> int:
        """Output tokens, those being sampled included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
