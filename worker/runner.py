"""ModelRunner: executes a StepPlan on one shard -- writes K/V into the cache, runs the layers, samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.attention import AttentionBackend, AttentionMetadata, AttentionStep, SeqAttention
from worker.model import Transformer
from worker.rope import rope_cache, rope_for
from worker.sampling import SampledToken, SamplingParams, sample


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


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]


@dataclass(frozen=True)
class StepOutput:
    sampled: dict[int, tuple[int, ...]]  # seq_id -> token ids drawn (one per requested sample)
    hidden: torch.Tensor | None = None  # a pipeline stage before the last: its output for the next stage
    # seq_id -> the drawn tokens with their logprobs, for the sequences that asked. Apart from ``sampled``
    # because plain ints cross a process boundary ~10x cheaper than objects (a decode step of 128).
    logprobs: dict[int, tuple[SampledToken, ...]] = field(default_factory=dict)


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
    ):
        """``graph_batch`` > 0: decode steps of up to that many sequences replay CUDA graphs (CUDA, a
        backend that does not gather, one TP rank, the whole model); padding rows use ``scratch_slot``, a
        slot the caller holds with one token backed. ``samples=False``: a TP rank whose peer samples."""
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = torch.device(device)
        self._rope = rope_cache(model.config, self.device)
        self._dtype = next(model.parameters()).dtype
        self.samples = samples
        self._graphs = None
        if graph_batch:
            if self.device.type != "cuda" or backend.reads == "rows":
                raise ValueError("CUDA graphs need a CUDA device and an attention backend that reads the cache in place")
            if not (model.is_first and model.is_last) or scratch_slot is None:
                raise ValueError("CUDA graphs need the whole model on one worker and a scratch slot")
            from worker.graphs import DecodeGraphs

            self._graphs = DecodeGraphs(model, cache, backend, self._rope, graph_batch, scratch_slot)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, inputs: torch.Tensor | None = None) -> StepOutput:
        """Run ``plan``; ``inputs`` are the previous pipeline stage's hidden states (none on the first)."""
        chunks = plan.chunks
        for c in chunks:
            held = self.cache.num_tokens(c.slot)
            if c.start + len(c.token_ids) > held:
                raise ValueError(f"seq {c.seq_id}: tokens up to {c.start + len(c.token_ids)} but slot {c.slot} backs {held}")
        if (inputs is None) != self.model.is_first:
            raise ValueError("the first pipeline stage takes token ids, every later one the previous stage's output")
        if not self.model.is_last:
            return StepOutput({}, self._eager_hidden(chunks, inputs))
        wanted = [i for i, c in enumerate(chunks) if c.num_samples] if self.samples else []
        if not wanted:  # the layers still run: they write K/V (and join the TP all-reduces)
            self._eager_hidden(chunks, inputs)
            return StepOutput({})
        if self._graphs is not None and self._graphs.fits(chunks):
            logits = self._graphs.logits(chunks)[wanted]
        else:
            hidden = self._eager_hidden(chunks, inputs)
            ends = torch.tensor([len(c.token_ids) for c in chunks]).cumsum(0) - 1
            logits = self.model.logits(hidden[ends[wanted].to(self.device)])
        return self._sample(chunks, wanted, logits)

    def _eager_hidden(self, chunks: tuple[ScheduledChunk, ...], inputs: torch.Tensor | None) -> torch.Tensor:
        positions = torch.cat([torch.arange(c.start, c.start + len(c.token_ids)) for c in chunks]).to(self.device)
        if inputs is None:
            inputs = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)
        else:
            inputs = inputs.to(self.device)
        seqs = [SeqAttention(c.slot, len(c.token_ids), c.start + len(c.token_ids)) for c in chunks]
        meta = AttentionMetadata.build(seqs, self.cache, self.device, self.backend.reads)
        rope = rope_for(self._rope, positions, self._dtype)
        return self.model(inputs, rope, AttentionStep(self.cache, self.backend, meta))

    def _sample(self, chunks: tuple[ScheduledChunk, ...], wanted: list[int], logits: torch.Tensor) -> StepOutput:
        # Greedy rows without logprobs take one batched argmax: one device sync for the whole step.
        argmax = logits.argmax(-1).tolist()
        sampled, logprobs = {}, {}
        for row, i in enumerate(wanted):
            c = chunks[i]
            if c.params.greedy and c.params.logprobs is None:
                sampled[c.seq_id] = (argmax[row],) * c.num_samples
                continue
            drawn = tuple(sample(logits[row], c.params, c.sample_index + k, c.output_index, c.seed)
                          for k in range(c.num_samples))
            sampled[c.seq_id] = tuple(t.token_id for t in drawn)
            if c.params.logprobs is not None:
                logprobs[c.seq_id] = drawn
        return StepOutput(sampled, logprobs=logprobs)
