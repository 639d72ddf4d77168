"""Scheduler: FCFS continuous batching with chunked prefill, admission by free pages, and preemption.

Plain Python over a ``PageLedger`` -- the page accounting of the workers' caches, with no memory behind
it; every decision it records (alloc, free, ensure, share, swap) is replayed by every worker. Each step every running sequence
gets the tokens it still lacks (one for decode, a chunk for prefill) within a token budget, then waiting
sequences are admitted while slots, pages and budget allow. When pages run out, the latest-arrived running
sequences are preempted -- by recompute (drop the K/V, compute it again later) or by swap (copy it to host
memory and back).

A step's progress counts when it is scheduled, so the next step can be scheduled while this one runs
(async scheduling): a sequence whose token is still being sampled is ``pending``; the next step feeds that
token back as a placeholder its worker fills in, and a sequence whose pending token is its last by length
is left out. ``postprocess`` then drops a token sampled for a sequence that ended meanwhile (a stop token
found one step late, an abort). With more steps in flight (``EngineConfig.async_depth``) a sequence has a token
pending from each; a step's placeholder is always the token the step just before it draws.

With pipeline parallelism the steps in flight are micro-batches over disjoint sequences (``micro_batches``, vLLM's
virtual engines): the first stage computes one while the next stage computes another. Each step takes at most its
share of ``max_num_seqs``, so that the steps in flight split the running sequences. The first stage does not see the
last stage's samples, so a sequence whose token is being sampled waits for it -- unless the last stage hands its drawn
tokens back to the first on the device (``token_ring``): then it takes a placeholder as many steps after its last as
there are stages, by when the last stage has drawn its token, and the scheduler need not have read it.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal

from cluster.sequence import Sequence, SeqStatus
from kvmem import KVCacheError, KVCacheExhausted, MappingPlan
from kvmem.ledger import EAGER_PAGES, PageLedger
from kvmem.ops import DropSwap, SwapIn, SwapOut
from kvmem.prefix import extend_page_hashes
from worker.sampling import SampledToken

#: Waiting requests' cached prefixes are mapped ahead (``Scheduler._prefixes_ahead``) a page for every this many tokens
#: the step computes, at most: a page of ``llama-3-8b``'s mega layout took 70-150 us to map in the engine on the
#: H100/H200, a token of its prefill ~23 us of the device's time, so the mapping hides behind the step.
#: ``VATTN_PREFIX_AHEAD_TOKENS`` sets it, to measure (0: none ahead; ``bench/peer.py``'s ``vattn-noprefixahead``).
PREFIX_AHEAD_TOKENS = 8
#: Requests next in line looked at: those the room the running ones leave admits, at least the first (some running
#: ones end in the step), at most the last (a step's worth of questions on shared prompts; each is looked at again
#: every step while it waits).
PREFIX_AHEAD_REQUESTS = (4, 32)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_bytes: int = 4 << 30
    max_model_len: int | None = None  # None: as long as the ledger's slots
    map_ahead: bool = True  # False: each step's pages are mapped in the step (the baseline the mapper hides)
    micro_batches: int = 1  # > 1: steps in flight over disjoint sequences, each of max_num_seqs / micro_batches at most
    # > 0, the pipeline's stages: the last stage hands each step's drawn tokens back to the first on the device
    # (``pipeline_handoff="ring"``), so a sequence whose token is in flight takes a step again this many steps after
    # its last, on a placeholder: by then the last stage has drawn it, and the first stage receives it.
    token_ring: int = 0
    # Free slots the mapper keeps holding pages of their own for the next new requests (``PageLedger.eager_ahead``
    # says how many pages a step), so that their prompts are written where pages are mapped already; 0: off.
    eager_slots: int = 0
    # > 0 (virtual layouts, prefix caching): a cached prefix of at least this many pages, on its first reuse in a slot
    # that does not hold it, is made one allocation (``PageLedger.fuse_prefix``) that later requests map whole; 0: off.
    fused_prefix_pages: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "micro_batches"):
            value = getattr(self, name)
            if name == "max_model_len" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("token_ring", "eager_slots", "fused_prefix_pages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise ValueError(f"swap_space must be an int >= 0 bytes, got {self.swap_space_bytes!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")

    @property
    def step_seqs(self) -> int:
        """The most sequences one step takes: a micro-batch's share of ``max_num_seqs``."""
        return -(-self.max_num_seqs // self.micro_batches)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # the first position computed this step
    num_tokens: int  # tokens computed this step
    num_samples: int  # tokens drawn at the end of the chunk (0 mid-prompt; n for a request's first token)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: PageLedger, late_masks: bool = False):
        """``late_masks``: the executor takes a step's grammar masks after its launch, so a constrained sequence
        runs in the step launched while its last token is on the device (its draw waits for the mask)."""
        self.config = config
        self.kv = kv
        self.late_masks = late_masks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped_bytes: dict[int, int] = {}  # seq_id -> bytes its host copy holds (on the tightest worker)
        self.max_model_len = config.max_model_len or kv.spec.max_tokens
        self.num_preemptions = 0
        # Prefix caching (vLLM's counters): prompt tokens of the sequences admitted to compute from the start, and
        # how many of them were found cached.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._prefix_ahead_tokens = int(os.environ.get("VATTN_PREFIX_AHEAD_TOKENS", PREFIX_AHEAD_TOKENS))
        self._fresh: set[int] = set()  # pages cached in this schedule(), their K/V computed in the step it makes
        self.rounds = 0  # steps with a batch scheduled so far
        self._next_seq_id = 0
        self._eager_tokens = 0  # the latest new request's prompt tokens: what free slots are prepared for

    # -- intake --------------------------------------------------------------------------------
    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def continue_ids(self, previous: "Scheduler") -> None:
        """Number new sequences after ``previous``'s (a scheduler that replaces it)."""
        self._next_seq_id = max(self._next_seq_id, previous._next_seq_id)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._fresh.clear()
        if self.config.fused_prefix_pages:
            self.kv.adopt_fused()  # the slots the last step's fused runs were copied from take them: one copy held
        budget = self.config.max_num_batched_tokens
        most = self.step_seqs
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < most:
            seq = self.running[i]
            i += 1
            if self.ends_in_flight(seq) or (seq.pending and not self._continues_on_placeholder(seq)):
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._back(seq, seq.num_computed + n, out):
                break  # seq itself was preempted: it was the last running one
            self._take(seq, n, out)
            self._cache(seq)
            budget -= n
        if not out.preempted:
            budget = self._admit(budget, out)
        self.rounds += bool(out.scheduled)
        return out

    def _continues_on_placeholder(self, seq: Sequence) -> bool:
        """Whether ``seq``, whose token is in flight, takes this step on a placeholder for it: with one stage the
        worker that draws it fills it in; with pipeline stages only in a token ring, as many steps after its last as
        there are stages, when the last stage has drawn it; never where the draw after needs that token on the host
        (a grammar's mask, a bad word's ban)."""
        if seq.request.waits_for_its_last_token(self.late_masks):
            return False
        if self.config.token_ring:
            return seq.pending == 1 and self.rounds - seq.scheduled_round >= self.config.token_ring
        # The worker fills a placeholder from the step launched just before: with more than two steps in flight a
        # sequence that missed that step (no budget left) waits until its token is read.
        return self.config.micro_batches == 1 and seq.scheduled_round == self.rounds - 1

    @property
    def step_seqs(self) -> int:
        return self.config.step_seqs

    def ends_in_flight(self, seq: Sequence) -> bool:
        """``seq``'s token being sampled is its last by length: it needs no further step."""
        return bool(seq.pending) and (seq.num_generated >= seq.request.params.max_tokens
                                      or seq.num_tokens >= self.max_model_len)

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Put ``n`` tokens of ``seq`` in this step and count them computed."""
        samples = self._samples(seq, n)
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n, samples))
        seq.num_computed += n
        seq.scheduled_round = self.rounds
        if samples:
            seq.pending += 1

    def _samples(self, seq: Sequence, n: int) -> int:
        if seq.num_computed + n < seq.num_tokens:
            return 0
        first_of_request = len(seq.request.seqs) == 1 and not seq.num_generated
        return seq.request.params.n if first_of_request else 1

    def _back(self, seq: Sequence, tokens: int, out: SchedulerOutput) -> bool:
        """Back ``tokens`` of ``seq``'s slot, preempting from the tail of ``running`` until it fits."""
        while True:
            try:
                self.kv.ensure(seq.slot, tokens)
                return True
            except KVCacheExhausted:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return False

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        most = self.step_seqs
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(out.scheduled) < most):
            seq = self.waiting[0]
            if seq.pending:
                # Preempted while its token was sampled, by a step before the last (the worker fills a placeholder
                # only from the last): it comes back with that token (first come, first served).
                break
            hit = self._cached_prefix(seq)
            try:
                slot = self.kv.alloc_slot(self._full_length(seq), self.kv.slot_holding(hit) if hit else None)
            except KVCacheError:
                break
            if hit:
                # The prefix's first reuse in another slot: fused into one allocation, so that every later one maps it
                # in one driver call a buffer (pages computed by this step are not there to copy yet).
                src = (self.kv.fusable(hit, slot, self.config.fused_prefix_pages)
                       if self.config.fused_prefix_pages and self._fresh.isdisjoint(hit) else None)
                if src is None:
                    self.kv.map_prefix(slot, hit)
                else:
                    self.kv.fuse_prefix(src, slot, hit)
                seq.num_cached_pages = len(hit)
                seq.num_computed = self.kv.spec.tokens_within(len(hit))
            n = min(seq.num_tokens - seq.num_computed, budget)
            try:
                self.kv.ensure(slot, seq.num_computed + n)
            except KVCacheExhausted:
                self.kv.free_slot(slot)
                if hit:
                    seq.num_computed = seq.num_cached_pages = 0
                break
            if seq.status is SeqStatus.WAITING and not seq.num_generated:
                # The next prompts' pages, not their growth: pages a request holds up to its expectation are no
                # one else's, and growth is mapped ahead as it comes.
                self._eager_tokens = seq.num_tokens
            if self.kv.prefixes is not None and seq.status is SeqStatus.WAITING:
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += seq.num_computed
            self.waiting.popleft()
            if seq.status is SeqStatus.SWAPPED:
                self.kv.record(SwapIn(seq.seq_id, slot))
                del self.swapped_bytes[seq.seq_id]
            seq.slot, seq.status = slot, SeqStatus.RUNNING
            seq.request.times.scheduled = seq.request.times.scheduled or time.monotonic()
            self.running.append(seq)
            self._take(seq, n, out)
            self._cache(seq)
            budget -= n
        return budget

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Keys of the held pages a sequence about to compute from its start can map instead; its last token is
        always computed (it yields the first sample).

        A page this step computes counts too: every layer writes the step's K/V before it reads any. Unless it is the
        last one mapped and a token runs over its end: that token is computed again, and its write copies the page
        first -- before the step, when the page holds nothing yet."""
        if (self.kv.prefixes is None or seq.status is not SeqStatus.WAITING or seq.num_computed
                or seq.request.params.prompt_logprobs is not None):  # every prompt token's logits are wanted
            return []
        spec = self.kv.spec
        keys = self.kv.cached_prefix(extend_page_hashes(seq.page_hashes, seq.token_ids, spec, seq.request.cache_salt))
        while keys and (spec.tokens_within(len(keys)) >= seq.num_tokens
                        or keys[-1] in self._fresh and spec.splits_token(len(keys))):
            keys.pop()
        return self.kv.whole_runs(keys)

    def _cache(self, seq: Sequence) -> None:
        """Index the pages of ``seq`` whose tokens are known and computed (by the steps scheduled so far)."""
        if self.kv.prefixes is None:
            return
        full = self.kv.spec.full_pages(min(seq.num_computed, len(seq.token_ids)))
        if full > seq.num_cached_pages:
            hashes = extend_page_hashes(seq.page_hashes, seq.token_ids, self.kv.spec, seq.request.cache_salt)
            self._fresh.update(self.kv.cache_pages(seq.slot, hashes[:full], seq.num_cached_pages))
            seq.num_cached_pages = full

    def _full_length(self, seq: Sequence) -> int:
        """The most tokens ``seq`` can reach: what its slot is expected to hold (pages past it are surplus)."""
        return min(seq.num_prompt_tokens + seq.request.params.max_tokens, self.max_model_len)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._cache(seq)
        size = seq.num_computed * self.kv.spec.bytes_per_token
        if self.config.preemption_mode == "swap" and self.swap_used_bytes + size <= self.config.swap_space_bytes:
            self.kv.record(SwapOut(seq.seq_id, seq.slot, seq.num_computed))
            self.swapped_bytes[seq.seq_id] = size
            seq.status = SeqStatus.SWAPPED
        else:
            seq.num_computed, seq.num_cached_pages, seq.status = 0, 0, SeqStatus.WAITING
        self.kv.free_slot(seq.slot)
        seq.slot = None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    @property
    def swap_used_bytes(self) -> int:
        return sum(self.swapped_bytes.values())

    def lookahead(self, out: SchedulerOutput) -> MappingPlan:
        """What the next step will need, for the AsyncMapper to map while this step computes: one more
        token for each sequence that samples now, the next chunk for each still in prefill. The ledger
        backs each at once; what it cannot back is left out (best effort: the next ``schedule`` preempts),
        so the plan every worker gets is one that fits every worker's pool. A slot whose next pages are
        shared is left out too: its copy-on-write must not race this step's writes; so is a sequence this
        step ends by length.

        With ``eager_slots``, free slots are then given pages for the next new requests (``PageLedger.eager_ahead``),
        which would else map their prompts' pages in their steps' launches: serving, where requests keep arriving.
        (Offline, all requests at once, it was measured as no gain in wall time on the H100 at 128 requests, with 30%
        more memory mapped.)"""
        if not self.config.map_ahead:
            return MappingPlan({})
        limit = self.kv.spec.max_tokens
        budget = self.config.max_num_batched_tokens
        targets = {}
        for s in out.scheduled:
            if self.ends_in_flight(s.seq):
                continue
            done = s.start + s.num_tokens
            step = 1 if s.num_samples else min(s.seq.num_tokens - done, budget)
            budget -= step
            targets[s.seq.slot] = min(done + step, limit)
        needs = self.kv.ensure_ahead(targets)  # those left out, the next step's recorded ensure backs
        plan = MappingPlan(needs)
        if self.config.eager_slots and self._eager_tokens and self.kv.keeps_pages_on_free:
            eager = self.kv.eager_ahead(self._eager_tokens, self.config.eager_slots)
            if eager is not None:
                plan = replace(eager, needs=needs)
        prefixes = self._prefixes_ahead(out)
        return plan if prefixes is None else replace(plan, prefixes=prefixes)

    def _prefixes_ahead(self, out: SchedulerOutput) -> tuple | None:
        """The cached prefixes of the requests next in line, mapped into free slots while this step computes
        (``PageLedger.prefix_ahead``): each would else map its prefix in the launch of the step that admits it, the
        device waiting (a step of 32 questions on shared 2-4K-token prompts mapped ~3,000 pages, more than the
        ~200 ms step before it). What is not mapped ahead (``PREFIX_AHEAD_TOKENS``) is mapped at admission, as
        before."""
        if self.kv.prefixes is None or not self.kv.keeps_pages_on_free or not self._prefix_ahead_tokens:
            return None
        hits, (least, most) = [], PREFIX_AHEAD_REQUESTS
        for seq in itertools.islice(self.waiting, min(max(self.config.max_num_seqs - len(self.running), least), most)):
            if seq.pending:
                break
            if hit := self._cached_prefix(seq):
                if self.config.fused_prefix_pages and len(hit) >= self.config.fused_prefix_pages \
                        and not self.kv.fused(hit[0]):
                    continue  # fused at its admission (one copy on the stream), then mapped ahead in one call a buffer
                hits.append(hit)
        pages = max(EAGER_PAGES, sum(s.num_tokens for s in out.scheduled) // self._prefix_ahead_tokens) if hits else 0
        return self.kv.prefix_ahead(hits, pages)

    # -- results -------------------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: dict[int, tuple[int, ...]],
                    logprobs: dict[int, tuple[SampledToken, ...]] | None = None) -> list[Sequence]:
        """Append the token ids ``out`` sampled (with their ``logprobs`` for the sequences that asked);
        returns the sequences that got a token (forks of n > 1 requests included). A sequence that ended
        since ``out`` was scheduled gets none."""
        logprobs = logprobs or {}
        updated = []
        now = time.monotonic()
        for s in out.scheduled:
            seq = s.seq
            if not s.num_samples:
                continue
            seq.pending -= 1
            tokens = sampled.get(seq.seq_id, ())
            if not tokens or seq.status is SeqStatus.FINISHED:
                continue
            seq.request.times.first_token = seq.request.times.first_token or now
            drawn = logprobs.get(seq.seq_id)  # only for requests that asked
            self._append(seq, tokens[0], drawn and drawn[0])
            updated.append(seq)
            updated.extend(self._fork(seq, k, tokens[k], drawn and drawn[k]) for k in range(1, len(tokens)))
        return updated

    @staticmethod
    def _append(seq: Sequence, token: int, logprobs: SampledToken | None) -> None:
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)

    def _fork(self, parent: Sequence, index: int, token: int, logprobs: SampledToken | None) -> Sequence:
        """Parallel sample ``index`` of ``parent``'s request: shares the prompt's pages when a slot is free
        (and the parent still has its own: one preempted while its first token was sampled has none)."""
        prompt = parent.num_prompt_tokens
        child = Sequence(self.new_seq_id(), parent.request, index, list(parent.request.prompt_token_ids))
        parent.request.seqs.append(child)
        self._append(child, token, logprobs)
        if parent.slot is not None and len(self.running) < self.config.max_num_seqs:
            try:
                child.slot = self.kv.alloc_slot(self._full_length(child))
            except KVCacheError:
                child.slot = None
        if child.slot is None:
            self.waiting.appendleft(child)  # no slot now: it recomputes the prompt later
            return child
        self.kv.share_prefix(parent.slot, child.slot, prompt)
        child.num_computed, child.status = prompt, SeqStatus.RUNNING
        self.running.append(child)
        return child

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (stop condition met or request aborted); its slot and swap copy go."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self._cache(seq)
            self.kv.free_slot(seq.slot)
            seq.slot = None
        if self.swapped_bytes.pop(seq.seq_id, None) is not None:
            self.kv.record(DropSwap(seq.seq_id))
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if seq.request.finished:
            seq.request.times.finished = time.monotonic()
