"""LLM: the in-process engine -- scheduler, model runner, KV cache and async mapper in one loop.

Each step: schedule, hand the pages the *next* step will need to the AsyncMapper, run the model while it
maps, then append tokens and apply stop conditions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from collections.abc import Iterator, Sequence as Seq

import torch
from tqdm import tqdm

from cluster.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cluster.scheduler import Scheduler, SchedulerConfig
from cluster.sequence import Request, Sequence, SeqStatus
from kvmem import AsyncMapper, KVCacheExhausted, KVCacheSpec, PagedKVCache, VirtualKVCache, default_vmm
from worker.attention import IN_PLACE, get_backend
from worker.loader import build_model
from worker.model import Transformer
from worker.runner import ModelRunner, ScheduledChunk, StepPlan
from worker.sampling import SamplingParams
from worker.tokenizer import load_tokenizer

Prompt = str | list[int]  # text, or token ids
Prompts = Prompt | Seq[Prompt]
ParamsArg = SamplingParams | Seq[SamplingParams] | None  # one for all prompts, or one per prompt


@dataclass(frozen=True)
class StepInfo:
    """What the last step ran (for benchmarks and metrics)."""

    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int  # tokens of chunks that did not end in a sample, or that were longer than one
    num_preempted: int


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLM:
    """Generate with a Llama-family model over a vAttention (``mega``/``per_layer``) or paged KV cache.

    ``model`` is a preset name, a Hugging Face model directory, or an already built ``Transformer``
    (token-id prompts; byte-level text). ``kv_memory`` is the physical KV pool in bytes. ``attention``
    defaults to ``fa2`` for a virtual cache on CUDA, ``paged`` for the paged layout and ``torch`` otherwise;
    ``flash_attn`` (the flash-attn package, where installed) on a virtual cache on CUDA is the other choice.
    ``cuda_graphs`` (default: with ``fa2`` or ``flash_attn``) replays decode steps as CUDA graphs.
    """

    def __init__(
        self,
        model: str | Transformer = "tiny",
        *,
        kv_layout: str = "mega",
        attention: str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        kv_memory: int = 1 << 30,
        page_size: int = 2 << 20,
        block_size: int = 16,
        preemption_mode: str = "recompute",
        swap_space: int = 4 << 30,
        dtype: str = "auto",
        device: str | None = None,
        cuda_graphs: bool | None = None,
        seed: int = 0,
        progress: bool = False,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
        attention = attention or ("paged" if kv_layout == "paged" else "fa2" if self.device.type == "cuda" else "torch")
        if attention in IN_PLACE and (kv_layout == "paged" or self.device.type != "cuda"):
            raise ValueError(f"attention {attention!r} needs a virtual KV layout (mega/per_layer) on CUDA")
        if cuda_graphs is None:
            cuda_graphs = attention in IN_PLACE
        if cuda_graphs and attention not in IN_PLACE:
            raise ValueError(f"cuda_graphs need an attention backend that reads the cache in place {IN_PLACE}, got {attention!r}")
        backend = get_backend(attention, self.device)  # a missing package fails before weights load
        if isinstance(model, Transformer):
            self.model = model
        else:
            self.model = build_model(model, DTYPES[dtype], self.device, seed=seed, progress=progress)
        config = self.model.config
        self.tokenizer = load_tokenizer(model if isinstance(model, str) else "", config.eos_token_ids)
        self.max_model_len = min(max_model_len or config.max_context, config.max_context)
        if attention in IN_PLACE and config.head_dim % 8:
            # FlashAttention pads such heads, and padding a K/V cache copies all of it, unmapped pages too.
            raise ValueError(f"attention {attention!r} needs head_dim a multiple of 8, got {config.head_dim}")
        # CUDA graphs hold one slot as scratch for padded rows.
        slots = max_num_seqs + (1 if cuda_graphs else 0)
        self.cache = self._make_cache(kv_layout, DTYPES[dtype], slots, kv_memory, page_size, block_size)
        try:
            self.runner = ModelRunner(self.model, self.cache, backend, self.device, max_num_seqs if cuda_graphs else 0)
            self.scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, preemption_mode, swap_space), self.cache)
            self.mapper = AsyncMapper(self.cache)
        except BaseException:
            self.cache.close()  # a failed constructor leaves no reservation behind
            raise
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_step: StepInfo | None = None

    def _make_cache(self, layout: str, dtype, max_seqs: int, kv_memory: int, page_size: int, block_size: int):
        c = self.model.config
        page = block_size if layout == "paged" else page_size  # tokens per block, or bytes per page
        spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, dtype, max_seqs, self.max_model_len, layout, page)
        if layout == "paged":
            return PagedKVCache(spec, kv_memory, self.device)
        return VirtualKVCache(spec, kv_memory, default_vmm(self.device))

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        """Queue a prompt (text or token ids); returns its request id. Bad input raises ``ValueError``
        naming the field and leaves the engine serving the other requests."""
        return self._enqueue(*self._prepare(prompt, params))

    def _prepare(self, prompt: Prompt, params: SamplingParams | None) -> tuple[str | None, list[int], SamplingParams]:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the maximum context is {self.max_model_len}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if not self.cache.fits(longest):
            raise ValueError(
                f"request needs {longest} tokens of KV cache in one slot, more than the whole pool "
                f"({self.cache.stats().pool_bytes} bytes) can hold: it could never run"
            )
        return (prompt if isinstance(prompt, str) else None), ids, params

    def _enqueue(self, text: str | None, ids: list[int], params: SamplingParams) -> str:
        request_id = str(next(self._ids))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        request = Request(request_id, text, tuple(ids), params, seed)
        seq = Sequence(self.scheduler.new_seq_id(), request, 0, list(ids))
        request.seqs.append(seq)
        self._requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its memory is freed."""
        request = self._requests.pop(request_id, None)
        for seq in request.seqs if request else ():
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, "abort")

    # -- the loop ------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One scheduling step; returns the requests that made progress (finished ones removed), or with
        ``finished_only`` just those that finished (no text is built for the others)."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_work and not self.scheduler.running:
                raise RuntimeError("no waiting request fits in the KV cache and nothing runs to free memory")
            return []
        self.last_step = StepInfo(
            len(out.scheduled),
            sum(s.num_tokens for s in out.scheduled),
            sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1 or not s.num_samples),
            len(out.preempted),
        )
        ahead = self.mapper.submit(self.scheduler.lookahead(out))
        plan = StepPlan(tuple(self._chunk(s.seq, s.num_tokens, s.num_samples) for s in out.scheduled))
        result = self.runner.execute(plan)
        try:
            self.mapper.wait(ahead)
        except KVCacheExhausted:
            pass  # mapping ahead is best effort; the next schedule() preempts if memory is short
        updated = self.scheduler.postprocess(out, result.sampled)
        for seq in updated:
            self._check_stop(seq)
        touched = {seq.request.request_id: seq.request for seq in updated}
        outputs = [self._output(r) for r in touched.values() if r.finished or not finished_only]
        for o in outputs:
            if o.finished:
                del self._requests[o.request_id]
        return outputs

    def _chunk(self, seq: Sequence, n: int, samples: int) -> ScheduledChunk:
        r = seq.request
        tokens = tuple(seq.token_ids[seq.num_computed : seq.num_computed + n])
        return ScheduledChunk(seq.seq_id, seq.slot, tokens, seq.num_computed, samples, r.params, r.seed,
                              seq.num_output_tokens, seq.sample_index)

    def _check_stop(self, seq: Sequence) -> None:
        p = seq.request.params
        token = seq.token_ids[-1]
        text = self.tokenizer.decode(seq.output_token_ids) if p.stop else ""  # once, not once per stop string
        reason = None
        if (token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif any(s in text for s in p.stop):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(seq, reason)

    def _output(self, r: Request) -> RequestOutput:
        completions = []
        for seq in sorted(r.seqs, key=lambda s: s.sample_index):
            text = self.tokenizer.decode(seq.output_token_ids)
            for stop in r.params.stop:
                if stop in text:
                    text = text[: text.index(stop)]
            logprobs = tuple(seq.logprobs) if r.params.logprobs is not None else None
            completions.append(CompletionOutput(seq.sample_index, text, tuple(seq.output_token_ids), seq.finish_reason, logprobs))
        t = r.times
        done = r.finished
        metrics = RequestMetrics(
            t.first_token - t.arrival if t.first_token else None,
            t.scheduled - t.arrival if t.scheduled else None,
            t.finished - t.arrival if t.finished else None,
            sum(s.num_preemptions for s in r.seqs),
        )
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, tuple(completions), done, metrics)

    def generate(
        self,
        prompts: Prompts,
        sampling_params: ParamsArg = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        finals = {o.request_id: o for o in self._run(prompts, sampling_params, use_tqdm, finished_only=True)}
        return [finals[i] for i in sorted(finals, key=int)]

    def stream(
        self,
        prompts: Prompts,
        sampling_params: ParamsArg = None,
        use_tqdm: bool = False,
    ) -> Iterator[RequestOutput]:
        """Yield a RequestOutput each time a request gains tokens, the last with ``finished=True``."""
        return self._run(prompts, sampling_params, use_tqdm, finished_only=False)

    def _run(self, prompts: Prompts, sampling_params: ParamsArg, use_tqdm: bool, finished_only: bool) -> Iterator[RequestOutput]:
        batch = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"{len(params)} sampling_params for {len(batch)} prompts")
        prepared = [self._prepare(p, sp) for p, sp in zip(batch, params)]  # all valid before any is queued
        ids = [self._enqueue(*args) for args in prepared]
        pending = set(ids)
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while pending:
                for o in self.step(finished_only):
                    if o.request_id in pending:
                        yield o
                        if o.finished:
                            pending.discard(o.request_id)
                            bar.update(1)

    def close(self) -> None:
        """Stop the mapper thread and give the KV memory back."""
        self.mapper.close()
        self.cache.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
