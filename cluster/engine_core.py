"""EngineCore: the scheduler's side of the engine -- requests, the step loop, stop conditions, outputs.

One step: schedule over the page ledger, ship one ``StepInput`` (the batch, the KV operations the ledger
recorded, the next step's mapping plan) to the executor, append what comes back. The same core runs in
the caller's process (``LLM``) and inside the Ray scheduler actor.

With async scheduling (vLLM v1's) two steps are in flight: each call schedules and submits step k+1, then
waits for step k, so the scheduler's work hides behind the workers' and the workers never wait for it.
Step k+1 feeds each sequence's token from step k back as a placeholder its worker fills in. A sequence that
step k ends (a stop token) wasted its step k+1 row; one that step k ends by length is not in step k+1.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, replace

from cluster.config import EnginePlan
from cluster.executor import Executor, PendingStep
from cluster.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cluster.scheduler import Scheduler, SchedulerOutput
from cluster.sequence import Request, Sequence, SeqStatus
from cluster.structured import GrammarCompiler
from cluster.telemetry import EngineSnapshot, RequestProgress, Telemetry
from worker.messages import PLACEHOLDER, NewSeq, StepInput
from worker.sampling import SampledToken, SamplingParams
from worker.tokenizer import Tokenizer

# Text, token ids, or vLLM's prompt dict: {"prompt": text} or {"prompt_token_ids": ids}, with an optional "cache_salt".
Prompt = str | list[int] | dict


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInfo:
    """What the last step ran (for benchmarks and metrics)."""

    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int  # tokens of chunks that did not end in a sample, or that were longer than one
    num_preempted: int


@dataclass(frozen=True)
class InFlight:
    """A step the workers have (or had) and whose result is not taken yet; ``late``: its sequences whose grammar
    masks the executor takes once the step before is read (``EngineCore._supply_masks``)."""

    out: SchedulerOutput
    info: StepInfo
    pending: PendingStep
    late: tuple[Sequence, ...] = ()


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, not yet queued."""

    request_id: str
    prompt: str | None
    token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None = None
    grammar: str | None = None  # ``params.structured_outputs`` compiled
    bad_words: tuple[tuple[int, ...], ...] = ()  # ``params.bad_words`` tokenized


def _banned(seq: Sequence) -> tuple[int, ...]:
    """The tokens that would complete one of ``seq``'s bad words after its output so far."""
    output = seq.output_token_ids
    ends_in = lambda head: not head or (len(head) <= len(output) and tuple(output[len(output) - len(head):]) == head)
    return tuple(sorted({w[-1] for w in seq.request.bad_words if ends_in(w[:-1])}))


def _unpack(prompt: dict, cache_salt: str | None) -> tuple[str | list[int], str | None]:
    """(text or token ids, cache salt) of a vLLM-style prompt dict."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
    if unknown:
        raise ValueError(f"prompt dict has unknown keys {unknown}: it takes 'prompt' or 'prompt_token_ids', and 'cache_salt'")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    return prompt.get("prompt", prompt.get("prompt_token_ids")), prompt.get("cache_salt", cache_salt)


#: A sequence whose incremental decoder failed is decoded whole each step instead (``EngineCore._text``).
DECODE_WHOLE = object()


class EngineCore:
    def __init__(self, plan: EnginePlan, executor: Executor, tokenizer: Tokenizer):
        self.plan = plan
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_model_len = plan.max_model_len
        self.telemetry = Telemetry(plan)
        self.grammars = GrammarCompiler(tokenizer, plan.model.vocab_size)
        self._seeds = random.Random(plan.config.seed)  # a request without a seed gets the next (vLLM's --seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._ended: list[RequestOutput] = []  # final outputs of aborted requests, for the next step to return
        self._deferred: Exception | None = None  # a failed flush, raised by the next step
        self._messages = itertools.count()  # numbers every StepInput (steps and flushes) for error messages
        self._in_flight: deque[InFlight] = deque()
        self._depth = plan.steps_in_flight
        self.num_overlapped_steps = 0  # steps submitted while an earlier one was in flight
        self.num_steps = 0
        self.num_rebuilds = 0
        self.last_step: StepInfo | None = None
        self._reset_scheduler()
        # The ledger's first operations (the CUDA graphs' scratch slot) now: the workers capture their graphs at them,
        # here, not in the first request's step.
        self.flush()

    def _reset_scheduler(self) -> None:
        self.ledger = self.plan.new_ledger()
        self.scheduler = Scheduler(self.plan.scheduler, self.ledger, getattr(self.executor, "late_masks", False))
        self._announced: set[int] = set()  # sequences whose sampling state the workers hold
        self._forget: list[int] = []  # announced sequences that finished since the last step

    # -- requests ------------------------------------------------------------------------------
    def prepare(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None = None,
                cache_salt: str | None = None) -> PreparedRequest:
        """Validate and tokenize; bad input raises ``ValueError`` naming the field. Touches no state but
        the id counter, so a caller may run it beside the step loop. ``request_id``: the caller's own (it
        keeps it unique), else the next number. ``cache_salt``: only requests with the same salt share cached
        prefix blocks (tenants that must not see each other's prompts, not even through timing)."""
        params = params or SamplingParams()
        if isinstance(prompt, dict):
            prompt, cache_salt = _unpack(prompt, cache_salt)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.plan.model.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if outside := [t for t, _ in params.logit_bias if t >= vocab]:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {outside[:8]}")
        if outside := [t for t in params.allowed_token_ids if t >= vocab]:
            raise ValueError(f"allowed_token_ids must be in [0, {vocab}), got {outside[:8]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the maximum context is {self.max_model_len}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        spec, pages = self.plan.ledger_spec, self.plan.slot_pages
        if spec.pages_for(longest) > pages:
            raise ValueError(
                f"request needs {longest} tokens of KV cache in one slot, {spec.pages_for(longest)} pages; "
                f"each worker's pool holds {pages} for a request: it could never run"
            )
        text = prompt if isinstance(prompt, str) else None
        grammar = self.grammars.grammar(params.structured_outputs) if params.structured_outputs is not None else None
        return PreparedRequest(request_id if request_id is not None else str(next(self._ids)), text, tuple(ids), params,
                               cache_salt, grammar, self._bad_words(params.bad_words))

    def _bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word's token ids as written at a word's start and after a space (vLLM's two ways), without specials."""
        spelled = {tuple(self.tokenizer.encode(prefix + w.lstrip(), add_special_tokens=False))
                   for w in words for prefix in ("", " ")}
        return tuple(sorted(s for s in spelled if s))

    def add_requests(self, prompts: list[Prompt], params: list[SamplingParams | None], stream: bool = False) -> list[str]:
        """Validate every prompt, then queue them all (none is queued if one is bad); their ids. (``stream``
        matters to a remote engine, which buffers outputs; ``poll`` here returns what the caller asks.)"""
        prepared = [self.prepare(p, sp) for p, sp in zip(prompts, params, strict=True)]
        return [self.add(r) for r in prepared]

    def add(self, request: PreparedRequest) -> str:
        params = request.params
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        r = Request(request.request_id, request.prompt, request.token_ids, params, seed, request.cache_salt,
                    request.grammar, request.bad_words)
        seq = Sequence(self.scheduler.new_seq_id(), r, 0, list(request.token_ids))
        r.seqs.append(seq)
        self._requests[r.request_id] = r
        self.scheduler.add(seq)
        return r.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its memory is freed. The next ``step`` returns its final output
        (``finish_reason="abort"``); an unknown or finished id is ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        try:
            for seq in request.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    self._finish(seq, "abort")
        finally:  # its client hears of it even if freeing its memory failed (the next step then recovers)
            self._ended.append(self._output(request, ended="abort"))
            self._retire(request, "abort")
        if not self.has_work:
            self._flush_or_defer()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block (running requests keep what they hold); how many were dropped."""
        dropped = self.ledger.reset_prefixes()
        if not self.has_work:
            self._flush_or_defer()
        return dropped

    def start_profile(self, directory: str) -> None:
        """Every worker records its steps under torch's profiler until ``stop_profile`` (``Worker.start_profile``)."""
        self.executor.start_profile(str(directory))

    def stop_profile(self) -> list[str]:
        """Stop recording; every worker's trace (pp-major), each on its worker's host."""
        return self.executor.stop_profile()

    def poll(self, pending: set[str], finished_only: bool) -> list[RequestOutput]:
        return self.step(finished_only)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._in_flight)

    @property
    def requests(self) -> set[str]:
        """Ids of the requests this core holds (queued, running, or swapped)."""
        return set(self._requests)

    # -- the loop ------------------------------------------------------------------------------
    def step(self, finished_only: bool = False, streamed: set[str] = frozenset()) -> list[RequestOutput]:
        """One scheduling step; returns the requests that made progress (finished ones removed), or with
        ``finished_only`` just those that finished and those in ``streamed`` (no text is built for the others).
        Requests aborted since the last step come first, finished. Raises what the last flush raised."""
        if self._deferred is not None:
            error, self._deferred = self._deferred, None
            raise error
        start = time.perf_counter()
        # Not past a step whose draw waits for grammar masks: they come once the step before it is read, and the
        # workers launch nothing behind a draw not queued yet (with more than two steps in flight).
        submitted = (len(self._in_flight) < self._depth and not (self._in_flight and self._in_flight[-1].late)
                     and self._submit_next())
        if not self._in_flight:
            if self.scheduler.has_work and not self.scheduler.running:
                raise RuntimeError("no waiting request fits in the KV cache and nothing runs to free memory")
            return self._take_ended()
        if submitted and len(self._in_flight) < self._depth:
            return self._take_ended()  # the first step of a busy spell: the next call takes its result
        outputs = self._complete(self._in_flight.popleft(), finished_only, streamed)
        self._supply_masks()
        self.telemetry.record_step(self.last_step.num_prefill_tokens, time.perf_counter() - start)
        while self._in_flight and not self.scheduler.has_work:
            # Rows of sequences that ended while they were in flight (a stop token found a step late): let the
            # workers finish them now, so that an idle engine holds nothing and the flush below frees it all.
            outputs += self._complete(self._in_flight.popleft(), finished_only, streamed)
            self._supply_masks()
        if not self.has_work:
            self._flush_or_defer()  # these outputs are final whatever the workers do next
        return self._take_ended() + outputs

    def _complete(self, step: InFlight, finished_only: bool, streamed: set[str]) -> list[RequestOutput]:
        """Take ``step``'s tokens: append them, check stops, build the outputs the caller wants."""
        result = step.pending.result()
        self.last_step = step.info
        self.num_steps += 1
        self.telemetry.record(result.reports)
        updated = self.scheduler.postprocess(step.out, result.sampled, result.logprobs)
        if result.prompt_logprobs:
            self._take_prompt_logprobs(step.out, result.prompt_logprobs)
        self.telemetry.record_tokens(updated, step.info.num_tokens)
        for seq in updated:
            if seq.request.grammar is not None and self._match(seq):
                continue
            self._check_stop(seq)
        touched = {seq.request.request_id: seq.request for seq in updated}
        outputs = [self._output(r) for r in touched.values() if r.finished or not finished_only or r.request_id in streamed]
        for o in outputs:
            if o.finished:
                self._retire(self._requests.pop(o.request_id), o.outputs[0].finish_reason)
        return outputs

    def _retire(self, request: Request, reason: str) -> None:
        """A request whose final output is built: counted, and its sequences let go of (``Request.release``)."""
        self.telemetry.record_finished(request, reason)
        request.release()

    def _supply_masks(self) -> None:
        """The grammar masks the next step in flight waits for, now that the tokens before them are read and
        matched (a sequence that ended meanwhile draws unmasked: its token is dropped)."""
        if not self._in_flight or not self._in_flight[0].late:
            return
        step = self._in_flight[0]
        masks = {seq.seq_id: None if seq.status is SeqStatus.FINISHED else self._matcher(seq).compute_bitmask()
                 for seq in step.late}
        step.pending.supply_masks(masks)
        self._in_flight[0] = replace(step, late=())

    def _submit_next(self) -> bool:
        """Schedule a step and hand it to the executor; False when nothing could be scheduled."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return False
        info = StepInfo(
            len(out.scheduled),
            sum(s.num_tokens for s in out.scheduled),
            sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1 or not s.num_samples),
            len(out.preempted),
        )
        step = self._step_input(out)
        pending = self.executor.submit(step)
        self.num_overlapped_steps += bool(self._in_flight)
        late = ()
        if step.late_masks:
            ids = set(step.late_masks)
            late = tuple(s.seq for s in out.scheduled if s.seq.seq_id in ids)
        self._in_flight.append(InFlight(out, info, pending, late))
        return True

    def _take_ended(self) -> list[RequestOutput]:
        # Taken only once a step succeeded: one that raises leaves them to ``recover`` / ``fail_all``.
        ended, self._ended = self._ended, []
        return ended

    def flush(self) -> None:
        """Send the workers what the ledger recorded since the last step (the frees of the last requests to
        finish, an abort) without a batch, so that an idle engine's workers hold what its ledger holds."""
        if self.ledger.has_ops or self._forget:
            forget, self._forget = tuple(self._forget), []
            step = StepInput(next(self._messages), (), forget, self.ledger.take_ops())
            self.telemetry.record(self.executor.execute(step).reports)

    def _flush_or_defer(self) -> None:
        try:
            self.flush()
        except Exception as exc:  # the next step raises it, and the caller recovers then
            self._deferred = exc

    def _step_input(self, out: SchedulerOutput) -> StepInput:
        # Backed in the ledger now, mapped by the workers meanwhile; the prefix pages evicted for it go with this step's
        # operations, which the workers apply before their mappers start on it.
        plan = self.scheduler.lookahead(out)
        ops = self.ledger.take_ops()
        new, seq_ids, slots, starts, samples, produced, tokens, offsets = [], [], [], [], [], [], [], [0]
        allowed = {}  # seq_id -> the token bitmask of its grammar's next token
        late = []  # sequences whose bitmask follows (``_supply_masks``): their last token is on the device
        banned = {}  # seq_id -> the token ids that would complete one of its bad words
        for s in out.scheduled:
            seq = s.seq
            if seq.seq_id not in self._announced:
                self._announced.add(seq.seq_id)
                p = seq.request.params
                history = ((tuple(seq.request.prompt_token_ids), tuple(seq.output_token_ids))
                           if p.penalized or p.prompt_logprobs is not None else ())
                new.append(NewSeq(seq.seq_id, seq.request.params, seq.request.seed, seq.sample_index, *history))
            seq_ids.append(seq.seq_id)
            slots.append(seq.slot)
            starts.append(s.start)
            samples.append(s.num_samples)
            known = seq.token_ids[s.start : s.start + s.num_tokens]
            tokens.extend(known)
            if len(known) < s.num_tokens:  # the token step k samples for it: its worker fills it in
                tokens.append(PLACEHOLDER)
            # Tokens generated before this step's sample (the pending one counted once this step is).
            produced.append(seq.num_generated - (1 if s.num_samples else 0))
            offsets.append(len(tokens))
            if s.num_samples and seq.request.grammar is not None:
                if len(known) < s.num_tokens:  # the mask follows the token the step before draws
                    late.append(seq.seq_id)
                else:
                    allowed[seq.seq_id] = self._matcher(seq).compute_bitmask()
            if s.num_samples and seq.request.bad_words and (ban := _banned(seq)):
                banned[seq.seq_id] = ban
        forget, self._forget = tuple(self._forget), []
        return StepInput(next(self._messages), tuple(new), forget, ops, plan.needs, tuple(seq_ids), tuple(slots),
                         tuple(starts), tuple(samples), tuple(produced), tuple(tokens), tuple(offsets), allowed, banned,
                         tuple(late), eager=plan.eager_args, prefixes=plan.prefixes)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if seq.seq_id in self._announced:
            self._announced.discard(seq.seq_id)
            self._forget.append(seq.seq_id)

    def _check_stop(self, seq: Sequence) -> None:
        p = seq.request.params
        token = seq.token_ids[-1]
        text = self._text(seq) if p.stop else ""
        reason = None
        if (token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif any(s in text for s in p.stop):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason:
            self._finish(seq, reason)

    def _match(self, seq: Sequence) -> bool:
        """Advance ``seq``'s grammar over its new tokens (a fork's matcher starts at the output's start); True when
        the grammar ended it -- complete, nothing more allowed -- or its token broke it (a finish reason given)."""
        matcher = self._matcher(seq)
        new = seq.output_token_ids[seq.matched:]
        seq.matched += len(new)
        if not matcher.consume_tokens(new):
            logger.warning("seq %d: token %s broke its grammar (%s)", seq.seq_id, new, matcher.get_error())
            self._finish(seq, "stop")
            return True
        if matcher.is_stopped():
            self._finish(seq, "stop")
            return True
        return False

    def _matcher(self, seq: Sequence):
        """``seq``'s grammar matcher, made at its output's start the first time it is needed."""
        if seq.matcher is None:
            seq.matcher = self.grammars.matcher(seq.request.grammar)
        return seq.matcher

    def _text(self, seq: Sequence) -> str:
        """``seq``'s output text: while it runs, extended by its new tokens only (streaming and stop strings
        look at it every step); once finished, the whole output decoded once, exactly what ``decode`` gives."""
        if seq.status is SeqStatus.FINISHED:
            if seq.final_text is None:
                seq.final_text = self.tokenizer.decode(seq.output_token_ids, seq.request.params.skip_special_tokens)
            return seq.final_text
        if seq.detokenizer is None:
            seq.detokenizer = self.tokenizer.detokenizer(seq.request.params.skip_special_tokens)
        new = seq.token_ids[seq.num_prompt_tokens + seq.decoded:]
        seq.decoded += len(new)
        if seq.detokenizer is not DECODE_WHOLE:
            try:
                seq.text += "".join(map(seq.detokenizer.step, new))
                return seq.text
            except Exception:  # tokenizers' DecodeStream has raised on real tokenizers ("Invalid prefix encountered")
                seq.detokenizer = DECODE_WHOLE  # this sequence only, from now on: slower, never wrong
        whole = self.tokenizer.decode(seq.output_token_ids, seq.request.params.skip_special_tokens).rstrip("\ufffd")
        if whole.startswith(seq.text):  # streamed text is never taken back
            seq.text = whole
        return seq.text

    def _token_texts(self, seq: Sequence) -> dict[int, str]:
        """Texts of the tokens ``seq``'s logprobs name, decoding only the entries added since the last call."""
        known = seq.token_texts
        for t in seq.logprobs[seq.texts_for :]:
            for i in (t.token_id, *(t.top_logprobs or ())):
                if i not in known:
                    known[i] = self.tokenizer.decode([i])
        seq.texts_for = len(seq.logprobs)
        return dict(known)

    def _prompt_token_texts(self, r: Request) -> dict[int, str]:
        """Texts of the prompt's tokens and of the alternatives its logprobs name, each decoded once."""
        known = r.prompt_token_texts
        for i in (*r.prompt_token_ids, *(i for t in r.prompt_logprobs for i in t.top_logprobs or ())):
            if i not in known:
                known[i] = self.tokenizer.decode([i])
        return dict(known)

    @staticmethod
    def _take_prompt_logprobs(out: SchedulerOutput, computed: dict[int, tuple[int, tuple[SampledToken, ...]]]) -> None:
        """Add what a step computed of its requests' prompt logprobs; a prompt computed again (a preempted request)
        adds only positions not seen yet."""
        seqs = {s.seq.seq_id: s.seq for s in out.scheduled}
        for seq_id, (first, entries) in computed.items():
            held = seqs[seq_id].request.prompt_logprobs
            if first <= len(held) + 1:
                held.extend(entries[len(held) + 1 - first :])

    def _output(self, r: Request, error: str | None = None, ended: str | None = None) -> RequestOutput:
        """``r``'s output; ``error`` or ``ended`` (a finish reason) make it final even before all n samples
        exist -- the missing ones are empty completions with that reason, so a client finds all n."""
        completions = []
        for seq in sorted(r.seqs, key=lambda s: s.sample_index):
            text = self._text(seq)
            if hits := [(text.index(stop), stop) for stop in r.params.stop if stop in text]:
                at, stop = min(hits)  # the earliest; include_stop_str_in_output keeps it
                text = text[: at + (len(stop) if r.params.include_stop_str_in_output else 0)]
            logprobs = texts = None
            if r.params.logprobs is not None:
                logprobs, texts = tuple(seq.logprobs), self._token_texts(seq)
            completions.append(CompletionOutput(seq.sample_index, text, tuple(seq.output_token_ids), seq.finish_reason,
                                                logprobs, texts))
        reason = "error" if error is not None else ended
        if reason is not None:
            empty = () if r.params.logprobs is not None else None
            completions += [CompletionOutput(k, "", (), reason, empty) for k in range(len(r.seqs), r.params.n)]
        t = r.times
        metrics = RequestMetrics(
            t.first_token - t.arrival if t.first_token else None,
            t.scheduled - t.arrival if t.scheduled else None,
            t.finished - t.arrival if t.finished else None,
            sum(s.num_preemptions for s in r.seqs),
        )
        prompt_logprobs = prompt_texts = None
        if r.params.prompt_logprobs is not None:
            prompt_logprobs, prompt_texts = (None, *r.prompt_logprobs), self._prompt_token_texts(r)
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, tuple(completions), r.finished or reason is not None,
                             metrics, error, prompt_logprobs, prompt_texts)

    @staticmethod
    def refused(request: PreparedRequest, error: str) -> RequestOutput:
        """The final output of a request that was accepted but never queued (its queueing failed)."""
        p = request.params
        return RequestOutput.failed(request.request_id, error, p.n, p.logprobs is not None, request.prompt, request.token_ids)

    # -- faults --------------------------------------------------------------------------------
    def recover(self, error: BaseException, keep_waiting: bool = True) -> list[RequestOutput]:
        """After the worker group failed: fail every request in flight with ``error``, rebuild the group
        and a fresh ledger, and queue again the requests that had not started (``keep_waiting``; not when
        the step itself is in doubt). Returns the failed outputs."""
        # The operator's only trace of it besides the rebuild counter: the requests' errors go to their clients.
        logger.error("the worker group failed; rebuilding it", exc_info=error)
        message = f"the worker group failed and was rebuilt; this request was in flight: {error}"
        outputs, self._deferred = self._ended, None  # stays in ``_ended`` until the rebuild is done, for ``fail_all``
        self._in_flight.clear()  # their results die with the workers
        failed, kept = [], []  # started requests lost their K/V with the workers
        for r in self._requests.values():
            started = any(s.status is not SeqStatus.WAITING or s.num_computed or s.num_output_tokens for s in r.seqs)
            (failed if started or not keep_waiting else kept).append(r)
        for r in failed:
            for seq in r.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    seq.status, seq.finish_reason, seq.slot = SeqStatus.FINISHED, "error", None
            outputs.append(self._output(r, message))
            self._retire(self._requests.pop(r.request_id), "error")
        self.executor.rebuild()
        self.num_rebuilds += 1
        self.telemetry.reset()
        old = self.scheduler
        self._reset_scheduler()
        for counter in ("num_preemptions", "prefix_queries", "prefix_hits"):  # counters never go back
            setattr(self.scheduler, counter, getattr(old, counter))
        self.scheduler.continue_ids(old)  # kept sequences keep their ids: new ones must not take them
        for r in kept:
            seq = r.seqs[0]
            # pending: a token it was drawing when it was preempted, lost with the workers: it starts over.
            seq.slot, seq.status, seq.pending = None, SeqStatus.WAITING, 0
            self.scheduler.add(seq)
        self._ended = []
        if not self.scheduler.has_work:
            self._flush_or_defer()  # the new workers take the new ledger's state (the graphs' scratch slot) now
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """The engine cannot go on: end every request with ``message``."""
        outputs, self._ended = self._ended, []
        self._in_flight.clear()
        for r in self._requests.values():
            for seq in r.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
            outputs.append(self._output(r, message))
            self._retire(r, "error")
        self._requests.clear()
        return outputs

    # -- telemetry -----------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        requests = []
        for r in self._requests.values():
            statuses = {s.status for s in r.seqs}
            status = next(st.value for st in (SeqStatus.RUNNING, SeqStatus.SWAPPED, SeqStatus.WAITING, SeqStatus.FINISHED)
                          if st in statuses)
            requests.append(RequestProgress(r.request_id, status, len(r.prompt_token_ids),
                                            sum(s.num_output_tokens for s in r.seqs), r.params.max_tokens,
                                            sum(s.num_preemptions for s in r.seqs)))
        s = self.scheduler
        swapped = sum(seq.status is SeqStatus.SWAPPED for seq in s.waiting)
        t = self.telemetry
        return EngineSnapshot(t.workers(self.ledger), tuple(requests), len(s.running), len(s.waiting) - swapped, swapped,
                              s.num_preemptions, self.num_steps, self.num_rebuilds, t.step_seconds, t.num_decode_steps,
                              t.decode_step_seconds, t.decode_busy_seconds,
                              self.ledger.pages_in_use() / self.plan.num_pages if self.plan.num_pages else 0.0,
                              t.prompt_tokens, t.generation_tokens, dict(t.finished),
                              {name: h.copy() for name, h in t.histograms.items()}, s.prefix_queries, s.prefix_hits,
                              self.num_overlapped_steps, self.plan.ledger_spec.tokens_within(self.plan.slot_pages),
                              self.ledger.prefix_runs_fused)

    def close(self) -> None:
        self.executor.close()

