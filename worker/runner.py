"""ModelRunner: executes a StepPlan on one shard -- writes K/V into the cache, runs the layers, samples."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch

from worker.attention import AttentionBackend, AttentionMetadata, AttentionStep, SeqAttention
from worker.graphs import BATCH_BUCKETS, DecodeGraphs, padded_rows
from worker.mixed_graphs import MixedGraphs
from worker.model import Transformer
from worker.parallel import TPGroup
from worker.penalties import PenaltyState
from worker.rope import rope_cache, rope_for
from worker.sampling import (SampledToken, SamplingParams, grammar_masked, needs_processing, noise_keys,
                             processed_logits, sample)
from worker.staging import to_device


@dataclass(frozen=True)
class ScheduledChunk:
    """``token_ids`` of sequence ``seq_id`` at positions ``start..`` in ``slot``; when ``num_samples`` > 0
    the step samples that many tokens from the chunk's last position (n > 1 forks draw several)."""

    seq_id: int
    slot: int
    token_ids: tuple[int, ...]
    start: int
    num_samples: int
    params: SamplingParams
    seed: int
    output_index: int  # tokens the sequence has generated so far (seeds the sampler)
    sample_index: int = 0  # which of the request's n samples this sequence is
    allowed: bytes | None = None  # structured outputs: a bit per token id its grammar allows next (little-endian words)
    banned: tuple[int, ...] = ()  # token ids its bad words ban at this draw
    # Prompt logprobs (``params.prompt_logprobs``): the prompt tokens that follow the chunk's first rows, one a row.
    prompt_targets: tuple[int, ...] = ()
    mask_later: bool = False  # its grammar mask (``allowed``) comes after the launch (``ModelRunner.sample_late``)


PROMPT_ROWS = 1024  # prompt rows whose logits are made at once: 1024 x a 128K vocabulary in float32 is 0.5 GiB


@dataclass(frozen=True)
class TokenFill:
    """Chunks whose last token is still on the device: chunk ``chunks[i]`` ends with ``source[rows[i]]``, a
    token an earlier step drew that nobody has read yet (async scheduling; see ``Worker.launch``)."""

    chunks: tuple[int, ...]
    source: torch.Tensor
    rows: tuple[int, ...]

    def apply(self, tokens: torch.Tensor, at: list[int]) -> None:
        """Write them into ``tokens`` at ``at`` (one index per chunk of ``chunks``)."""
        index = to_device(torch.tensor([at, list(self.rows)]), tokens.device)
        tokens[index[0]] = self.source[index[1]]


def _ends(chunks) -> torch.Tensor:
    """Each chunk's last row in the step's flattened tokens."""
    return torch.tensor([len(c.token_ids) for c in chunks]).cumsum(0) - 1


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A copy of device tensor ``t`` on its way to pinned host memory (read it after an event recorded later)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    fill: TokenFill | None = None


@dataclass(frozen=True)
class StepOutput:
    sampled: dict[int, tuple[int, ...]]  # seq_id -> token ids drawn (one per requested sample)
    hidden: torch.Tensor | None = None  # a pipeline stage before the last: its output for the next stage
    # seq_id -> the drawn tokens with their logprobs, for the sequences that asked. Apart from ``sampled``
    # because plain ints cross a process boundary ~10x cheaper than objects (a decode step of 128).
    logprobs: dict[int, tuple[SampledToken, ...]] = field(default_factory=dict)
    # seq_id -> (the prompt position of its first entry, its prompt tokens' logprobs), for the chunks that asked
    prompt_logprobs: dict[int, tuple[int, tuple[SampledToken, ...]]] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose kernels are queued: ``tokens`` ``[len(wanted)]`` are each sampling chunk's first drawn
    token, on the device; ``result`` reads what was drawn (the one wait for the device)."""

    chunks: tuple[ScheduledChunk, ...]
    wanted: tuple[int, ...] = ()  # chunks that sample, in row order
    tokens: torch.Tensor | None = None
    more: tuple[tuple[int, int], ...] = ()  # (row, draws): rows of n > 1 draws, the draws after their first
    logprob_rows: tuple[int, ...] = ()  # rows that asked for logprobs
    # On their way to host memory: the first draws, the later ones, the logprob of every draw of the logprob
    # rows (in order), and those rows' top logprobs and their token ids.
    host: tuple[torch.Tensor | None, ...] = ()
    done: StepOutput | None = None  # a step that samples nothing: its output as it is
    # Recorded after the step's kernels and copies (CUDA): waiting for it waits for this step only, not for the
    # steps queued behind it.
    queued: "torch.cuda.Event | None" = None
    begun: "torch.cuda.Event | None" = None  # recorded before the step's first kernel: with ``queued``, its device time
    prompt_logprobs: dict[int, tuple[int, tuple[SampledToken, ...]]] = field(default_factory=dict)  # read already
    # A step whose draw waits for grammar masks (``ModelRunner.sample_late``): the sampling rows' logits, queued.
    logits: torch.Tensor | None = None

    @property
    def awaits_masks(self) -> bool:
        return self.logits is not None

    @property
    def running(self) -> bool:
        """Its kernels are still queued or running on the device."""
        return self.queued is not None and not self.queued.query()

    @property
    def device_seconds(self) -> float:
        """From its first kernel's start to its last's end on the device (0 off CUDA); only once ``result`` returned."""
        return self.begun.elapsed_time(self.queued) / 1e3 if self.begun is not None else 0.0

    @property
    def rows(self) -> dict[int, int]:
        """seq_id -> its row of ``tokens``."""
        return {self.chunks[i].seq_id: row for row, i in enumerate(self.wanted)}

    def result(self) -> StepOutput:
        if self.awaits_masks:
            raise RuntimeError("a step's result was read before the grammar masks its draw waits for were supplied")
        if self.queued is not None:
            self.queued.synchronize()  # also for a step with nothing to read: its slots may be freed next
        if self.done is not None:
            return self.done
        first, later, chosen, top_values, top_ids = (t.tolist() if t is not None else [] for t in self.host)
        more, at = {}, 0
        for row, n in self.more:
            more[row], at = later[at : at + n], at + n
        top = dict(zip(self.logprob_rows, zip(top_ids, top_values)))
        sampled, logprobs, at = {}, {}, 0
        for row, i in enumerate(self.wanted):
            c = self.chunks[i]
            ids = (first[row], *more.get(row, ()))
            if c.params.greedy:
                ids = ids * c.num_samples  # n greedy samples are one token n times
            sampled[c.seq_id] = ids
            if c.params.logprobs is not None:
                k, (alt_ids, alt_values) = c.params.logprobs, top[row]
                alternatives = dict(zip(alt_ids[:k], alt_values[:k]))
                logprobs[c.seq_id] = tuple(SampledToken(t, chosen[at + m], alternatives) for m, t in enumerate(ids))
                at += len(ids)
        return StepOutput(sampled, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs)


def warm_row_counts(max_rows: int) -> list[int]:
    """Row counts from 16 up to ``max_rows`` (included), each 1.25x the one before."""
    counts, rows = [], 16.0
    while round(rows) < max_rows:
        counts.append(round(rows))
        rows *= 1.25
    return [*counts, max_rows]


@torch.inference_mode()
def warm_projections(layers: torch.nn.Module, max_rows: int) -> int:
    """Run each distinct projection shape of ``layers`` (a shard's QKV, output, gate/up and down products) once at
    each of ``warm_row_counts(max_rows)``; how many products ran. cuBLAS loads the kernel it picks for a row count the
    first time one needs it: an eager step that met a new one held its launch 91 ms on 2xH200 (a QKV projection of
    1,138 rows) while the device ran dry, and a server meets ever new prefill sizes. Only the products, no sums:
    the TP ranks need not be in step here."""
    weights = {(m.weight.shape, m.weight.dtype): m.weight for m in layers.modules() if isinstance(m, torch.nn.Linear)}
    counts = warm_row_counts(max_rows)
    for weight in weights.values():
        x = torch.zeros(max_rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        for rows in counts:
            torch.nn.functional.linear(x[:rows], weight)
    return len(weights) * len(counts)


class ModelRunner:
    """One shard's model and KV cache on one device."""

    def __init__(
        self,
        model: Transformer,
        cache,
        backend: AttentionBackend,
        device: torch.device | str,
        graph_batch: int = 0,
        scratch_slot: int | None = None,
        samples: bool = True,
        tp: TPGroup = TPGroup(),
        warm_rows: int = 0,
        mixed_tokens: int = 0,
    ):
        """``graph_batch`` > 0: decode steps of up to that many sequences replay CUDA graphs (CUDA, a
        backend that does not gather; ``tp``: this rank's group, whose ranks capture theirs in lock-step; a pipeline
        stage its own layers); padding rows use ``scratch_slot``, a slot the caller holds with one token backed.
        ``samples=False``: a TP rank whose peer samples (every rank samples where the LM head is split by vocabulary:
        the draw gathers from every rank). ``warm_rows`` > 0 (CUDA): the layers' projections run once at
        row counts up to it (``warm_projections``: a step's most tokens). ``mixed_tokens`` > 0 with ``graph_batch``:
        steps of up to that many tokens that prefill replay graphs too, where the backend runs a mixed step in one
        call (``MixedGraphs``)."""
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = torch.device(device)
        self._rope = rope_cache(model.config, self.device)
        self._dtype = next(model.parameters()).dtype
        self.samples = samples or model.vocab_tp is not None
        self._penalties: PenaltyState | None = None  # made for the first penalized sequence
        self._graphs = None
        if graph_batch:
            if self.device.type != "cuda" or backend.reads == "rows":
                raise ValueError("CUDA graphs need a CUDA device and an attention backend that reads the cache in place")
            if scratch_slot is None:
                raise ValueError("CUDA graphs need a scratch slot")
            self._graphs = DecodeGraphs(model, cache, backend, self._rope, graph_batch, scratch_slot, tp,
                                        logits=self.samples)
        self._mixed = None
        if graph_batch and mixed_tokens and getattr(backend, "graphs_mixed", False):
            self._mixed = MixedGraphs(model, cache, backend, self._rope, graph_batch, mixed_tokens, scratch_slot, tp)
        self._pads = self.device.type == "cuda" and model.is_last and self.samples
        if self._pads:
            self._warm_logits()
        if self.device.type == "cuda" and warm_rows:
            warm_projections(model.layers, warm_rows)

    @torch.inference_mode()
    def _warm_logits(self) -> None:
        """The LM head once at each row count eager steps pad their logits to, then the sampler. cuBLAS chooses
        and loads a kernel the first time it sees a shape: 0.24-0.32 s for each of six new row counts in a W1 run's
        first engine on the H100, which held the host up while the GPU ran dry."""
        h = torch.zeros(BATCH_BUCKETS[-1], self.model.config.hidden_size, dtype=self._dtype, device=self.device)
        for rows in BATCH_BUCKETS:
            logits = self.model.logits(h[:rows])
        # And the sampler's kernels, both paths, over the model's logits and over float32 ones (a step whose rows ask
        # for logprobs or penalties upcasts): Triton compiles the draw's the first time it runs, which would
        # otherwise stall the first step that samples a request (and every request batched with it).
        for rows, params in ((logits[:2], SamplingParams()), (logits[:2].float(), SamplingParams()),
                             (logits[:2], SamplingParams(top_k=2, top_p=0.5, min_p=0.1))):
            sample(rows, [params] * 2, [noise_keys(0, 0, 0)] * 2)

    @property
    def graphs_captured(self) -> bool:
        """Whether every kind of CUDA graph this runner replays is captured (True with none)."""
        return all(g.captured for g in (self._graphs, self._mixed) if g is not None)

    def capture_graphs(self) -> None:
        """Capture every CUDA graph this runner replays, unless done (each kind does so at its first step otherwise):
        once the scratch slot's page is mapped; every TP rank at the same point of its messages."""
        for graphs in (self._graphs, self._mixed):
            if graphs is not None:
                graphs.capture()

    def close(self) -> None:
        """Release the CUDA graphs, if any."""
        for graphs in (self._graphs, self._mixed):
            if graphs is not None:
                graphs.close()

    def execute(self, plan: StepPlan, inputs: torch.Tensor | None = None) -> StepOutput:
        """Run ``plan``; ``inputs`` are the previous pipeline stage's hidden states (none on the first)."""
        return self.launch(plan, inputs).result()

    def track(self, seq_id: int, prompt_token_ids: tuple[int, ...], output_token_ids: tuple[int, ...]) -> None:
        """Count a penalized sequence's tokens from now on (its prompt, and its output so far), where it is sampled."""
        if not (self.samples and self.model.is_last):
            return
        if self._penalties is None:
            self._penalties = PenaltyState(self.model.config.vocab_size, self.device)
        self._penalties.add(seq_id, prompt_token_ids, output_token_ids)

    def forget(self, seq_id: int) -> None:
        """A sequence ended: what was counted for it goes."""
        if self._penalties is not None:
            self._penalties.forget(seq_id)

    def launch(self, plan: StepPlan, inputs: torch.Tensor | None = None) -> LaunchedStep:
        """Queue ``plan``'s kernels and its sampling; nothing here waits for the device."""
        if self.device.type != "cuda":
            return self._queue(plan, inputs)
        begun, queued = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begun.record()
        launched = self._queue(plan, inputs)
        queued.record()
        return replace(launched, queued=queued, begun=begun)

    @torch.inference_mode()
    def _queue(self, plan: StepPlan, inputs: torch.Tensor | None) -> LaunchedStep:
        chunks = plan.chunks
        for c in chunks:
            held = self.cache.num_tokens(c.slot)
            if c.start + len(c.token_ids) > held:
                raise ValueError(f"seq {c.seq_id}: tokens up to {c.start + len(c.token_ids)} but slot {c.slot} backs {held}")
        if (inputs is None) != self.model.is_first:
            raise ValueError("the first pipeline stage takes token ids, every later one the previous stage's output")
        asks_prompt = any(c.prompt_targets for c in chunks)
        # Decided alike on every TP rank, sampling or not: a rank replaying a graph and its peer running the step
        # eagerly (or capturing at another time) join collectives of other shapes, and NCCL hangs (2xH200).
        graphed = self._graphs is not None and self._graphs.fits(chunks) and not asks_prompt
        mixed = not graphed and self._mixed is not None and self._mixed.fits(chunks) and not asks_prompt
        if not self.model.is_last:
            # A copy: the next replay of this bucket overwrites the graph's output while the hand-off may still read it.
            hidden = (self._graphs.run(chunks, plan.fill, inputs).clone() if graphed
                      else self._mixed.run(chunks, plan.fill, inputs).clone() if mixed
                      else self._eager_hidden(chunks, inputs, plan.fill))
            return LaunchedStep(chunks, done=StepOutput({}, hidden))
        wanted = tuple(i for i, c in enumerate(chunks) if c.num_samples) if self.samples else ()
        if graphed:
            out = self._graphs.run(chunks, plan.fill, inputs)  # the logits where this rank samples, else nothing to read
            if not wanted:
                return LaunchedStep(chunks, done=StepOutput({}))
            return self._draw(chunks, wanted, out if len(wanted) == len(chunks) else
                              out[to_device(torch.tensor(wanted), self.device)], {})
        prompt = asks_prompt and self.samples
        # The layers run on every rank: K/V, all-reduces
        hidden = self._mixed.run(chunks, plan.fill, inputs) if mixed else self._eager_hidden(chunks, inputs, plan.fill)
        prompt_logprobs = self._prompt_logprobs(chunks, hidden) if prompt else {}
        if not wanted:
            return LaunchedStep(chunks, done=StepOutput({}, prompt_logprobs=prompt_logprobs))
        rows = _ends(chunks)[list(wanted)]
        if self._pads:  # repeats of the last row up to a size _warm_logits has seen
            rows = torch.cat([rows, rows[-1:].expand(padded_rows(len(rows)) - len(rows))])
        return self._draw(chunks, wanted, self.model.logits(hidden[to_device(rows, self.device)])[: len(wanted)],
                          prompt_logprobs)

    def _draw(self, chunks: tuple[ScheduledChunk, ...], wanted: tuple[int, ...], logits: torch.Tensor,
              prompt_logprobs: dict) -> LaunchedStep:
        if any(chunks[i].mask_later for i in wanted):  # the draw waits for masks: ``sample_late``
            return LaunchedStep(chunks, wanted, prompt_logprobs=prompt_logprobs, logits=logits)
        return replace(self._sample(chunks, wanted, logits), prompt_logprobs=prompt_logprobs)

    @torch.inference_mode()
    def sample_late(self, launched: LaunchedStep, masks: dict[int, bytes | None]) -> LaunchedStep:
        """Queue the draw of a step launched without some grammar masks (``mask_later`` chunks), with ``masks``
        (seq_id -> bitmask; None: unmasked). The step's kernels stay queued: nothing here waits for the device."""
        if not launched.awaits_masks:
            raise RuntimeError("sample_late on a step whose draw is queued already")
        if missing := [c.seq_id for c in launched.chunks if c.mask_later and c.seq_id not in masks]:
            raise ValueError(f"no grammar mask for sequences {missing}")
        chunks = tuple(replace(c, allowed=masks[c.seq_id], mask_later=False) if c.mask_later else c for c in launched.chunks)
        drawn = replace(self._sample(chunks, launched.wanted, launched.logits), prompt_logprobs=launched.prompt_logprobs,
                        begun=launched.begun)
        if drawn.begun is None:
            return drawn
        queued = torch.cuda.Event(enable_timing=True)
        queued.record()
        return replace(drawn, queued=queued)

    def _prompt_logprobs(self, chunks: tuple[ScheduledChunk, ...], hidden: torch.Tensor) -> dict:
        """The logprob of each prompt token that follows a row of a chunk that asked, with its alternatives, read
        now: only steps of requests that ask wait for the device here."""
        out = {}
        firsts = list(accumulate((len(c.token_ids) for c in chunks), initial=0))  # each chunk's first row
        for i, c in enumerate(chunks):
            if not c.prompt_targets:
                continue
            k, entries = c.params.prompt_logprobs, []
            for at in range(0, len(c.prompt_targets), PROMPT_ROWS):
                targets = c.prompt_targets[at : at + PROMPT_ROWS]
                rows = hidden[firsts[i] + at : firsts[i] + at + len(targets)]
                logp = self.model.whole(self.model.logits(rows)).float().log_softmax(-1)
                chosen = logp.gather(1, to_device(torch.tensor(targets), logp.device)[:, None])[:, 0].tolist()
                if k:
                    top_values, top_ids = (t.tolist() for t in torch.topk(logp, k))
                else:
                    top_values = top_ids = [[]] * len(targets)
                entries += [SampledToken(t, lp, dict(zip(ids, values)))
                            for t, lp, ids, values in zip(targets, chosen, top_ids, top_values)]
            out[c.seq_id] = (c.start + 1, tuple(entries))
        return out

    def _eager_hidden(self, chunks: tuple[ScheduledChunk, ...], inputs: torch.Tensor | None, fill: TokenFill | None) -> torch.Tensor:
        positions = to_device(torch.cat([torch.arange(c.start, c.start + len(c.token_ids)) for c in chunks]), self.device)
        if inputs is None:
            inputs = to_device(torch.tensor([t for c in chunks for t in c.token_ids]), self.device)
            if fill is not None:
                fill.apply(inputs, _ends(chunks)[list(fill.chunks)].tolist())
        else:
            inputs = inputs.to(self.device)
        seqs = [SeqAttention(c.slot, len(c.token_ids), c.start + len(c.token_ids)) for c in chunks]
        meta = AttentionMetadata.build(seqs, self.cache, self.device, self.backend.reads)
        rope = rope_for(self._rope, positions, self._dtype)
        return self.model(inputs, rope, AttentionStep(self.cache, self.backend, meta))

    def _sample(self, chunks: tuple[ScheduledChunk, ...], wanted: tuple[int, ...], logits: torch.Tensor) -> LaunchedStep:
        # Greedy rows take one batched argmax, the others one batched draw (``sample``: each row's parameters and
        # noise, no loop over rows on the device); logprobs are worked out on the device too: nothing waits for the
        # device before the step's result is read.
        # One walk over the rows for what only some ask for: a grammar's mask, banned words, bias or min tokens,
        # penalties (vLLM's order).
        masked, banned, asks, penalized = [], [], [], []
        for row, i in enumerate(wanted):
            c = chunks[i]
            if c.allowed is not None:
                masked.append((row, c.allowed))
            if c.banned:
                banned.append((row, c.banned))
            if needs_processing(c.params, c.output_index):
                asks.append((row, c.params, c.output_index))
            if c.params.penalized:
                penalized.append((row, c))
        logprob_rows = tuple(row for row, i in enumerate(wanted) if chunks[i].params.logprobs is not None)
        sampled = [row for row, i in enumerate(wanted) if not chunks[i].params.greedy]
        # An LM head split by vocabulary: greedy rows alone take each rank's best token (16 bytes a row between the
        # ranks); anything else gathers the whole rows (as vLLM gathers its logits). Every rank decides alike.
        sliced = self.model.vocab_tp is not None and not (masked or asks or banned or penalized or logprob_rows
                                                          or sampled)
        logits = logits if sliced else self.model.whole(logits)
        if masked or asks or banned or penalized or logprob_rows:  # sums and softmaxes in float32, as the draw's
            logits = logits.float()
        raw = logits  # logprobs: the model's own
        if masked:
            logits = grammar_masked(logits, masked)
        if asks or banned:
            logits = processed_logits(logits, asks, self.model.config.eos_token_ids, banned)
        if penalized:
            logits = self._penalties.apply(logits, [row for row, _ in penalized], [c.seq_id for _, c in penalized],
                                           [c.params for _, c in penalized])
        # Where every row draws (temperature sampling for the whole batch: the server's default), no argmax.
        every_row_draws = bool(sampled) and len(sampled) == len(wanted)
        tokens = None if every_row_draws else (
            self.model.vocab_tp.argmax_columns(logits) if sliced else logits.argmax(-1))
        # The draws: every sampled row's first, then the later ones of each n > 1, row by row (``more``'s order).
        draws = [(row, 0) for row in sampled]
        more, later_from = [], {}  # row -> where its later draws start among the draws
        for row in sampled:
            if (n := chunks[wanted[row]].num_samples) > 1:
                more.append((row, n - 1))
                later_from[row] = len(draws)
                draws += [(row, k) for k in range(1, n)]
        every, later = tokens, None
        if draws:
            cs = [chunks[wanted[row]] for row, _ in draws]
            keys = [noise_keys(c.seed, c.sample_index + k, c.output_index) for c, (_, k) in zip(cs, draws)]
            # the rows as they are where the draws are the rows in order (no gathered copy of the logits)
            drawn = sample(logits if every_row_draws and not more else
                           logits[to_device(torch.tensor([row for row, _ in draws]), logits.device)],
                           [c.params for c in cs], keys)
            if every_row_draws:
                tokens = drawn[: len(sampled)]
            else:
                tokens[to_device(torch.tensor(sampled), logits.device)] = drawn[: len(sampled)]
            every = torch.cat([tokens, drawn])  # a draw's token: its row's for a first, len(tokens) + its place else
            later = drawn[len(sampled):] if more else None
        if penalized:  # the token each draws now counts in its next step's penalties, on the device
            at = to_device(torch.tensor([row for row, _ in penalized]), tokens.device)
            self._penalties.record([c.seq_id for _, c in penalized], tokens[at])
        chosen = top_values = top_ids = None
        if logprob_rows:
            rows = to_device(torch.tensor(logprob_rows), logits.device)
            logp = raw[rows].log_softmax(-1)
            picks = []  # (row among logprob_rows, the draw's place in ``every``), every draw of each
            for j, row in enumerate(logprob_rows):
                n, start = chunks[wanted[row]].num_samples, later_from.get(row)
                picks += [(j, row)] + [(j, row if start is None else len(tokens) + start + k) for k in range(n - 1)]
            at = to_device(torch.tensor([j for j, _ in picks]), logits.device)
            chosen = logp[at, every[to_device(torch.tensor([a for _, a in picks]), logits.device)]]
            top_values, top_ids = torch.topk(logp, max(chunks[wanted[r]].params.logprobs for r in logprob_rows))
        device_side = (tokens, later, chosen, top_values, top_ids)
        host = device_side if tokens.device.type != "cuda" else tuple(t if t is None else _to_pinned(t) for t in device_side)
        return LaunchedStep(chunks, wanted, tokens, tuple(more), logprob_rows, host)
