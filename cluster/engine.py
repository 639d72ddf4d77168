"""LLM: generate with a Llama-family model over a vAttention or paged KV cache, in this process or on Ray.

``distributed="local"`` runs the engine core and its one worker here; ``distributed="ray"`` starts a
scheduler actor that runs the same core over one worker actor per (pp stage, tp rank). The API is the same.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence as Seq
from typing import Protocol

import torch
from tqdm import tqdm

from cluster.config import EngineConfig, EnginePlan, plan
from cluster.engine_core import EngineCore, Prompt
from cluster.errors import EngineDeadError
from cluster.executor import LocalExecutor
from cluster.outputs import RequestOutput
from cluster.telemetry import EngineSnapshot
from worker.model import Transformer
from worker.sampling import SamplingParams
from worker.tokenizer import load_tokenizer

Prompts = Prompt | Seq[Prompt]
ParamsArg = SamplingParams | Seq[SamplingParams] | None  # one for all prompts, or one per prompt


class Engine(Protocol):
    """What ``LLM`` drives: the in-process ``EngineCore`` or the Ray scheduler actor's client."""

    plan: EnginePlan  # what the config resolved to (the Ray engine's: before its workers sized their pools)

    def add_requests(self, prompts: list[Prompt], params: list[SamplingParams | None], stream: bool = False) -> list[str]: ...

    def poll(self, pending: set[str], finished_only: bool) -> list[RequestOutput]:
        """Progress since the last call (the in-process engine runs one step for it)."""

    def abort(self, request_id: str) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...

    def reset_prefix_cache(self) -> int: ...

    def start_profile(self, directory: str) -> None: ...

    def stop_profile(self) -> list[str]: ...

    def close(self) -> None: ...


class LLM:
    """Generate with a Llama-family model over a vAttention (``mega``/``per_layer``) or paged KV cache.

    ``model`` is a preset name, a Hugging Face model directory, or (in-process only) an already built
    ``Transformer`` (token-id prompts; byte-level text). ``kv_memory`` is each worker's physical KV pool in
    bytes. ``attention`` defaults on CUDA to the flash-attn package's kernels where it is installed
    (``flash_attn`` over a virtual cache, ``flash_attn_paged`` over the paged layout's 256-token blocks), else
    torch's FA2 (``fa2``; ``paged``: gather + FA2 over 16-token blocks), and to ``torch`` on CPU.
    ``cuda_graphs`` (default: with a backend that reads the cache in place and one worker) replays decode steps
    as CUDA graphs. With ``async_scheduling`` (the default) step k+1 is scheduled and queued on the device
    while step k runs; with pipeline stages it keeps a micro-batch of other sequences in flight a stage instead.

    ``distributed="ray"`` with ``tensor_parallel_size`` / ``pipeline_parallel_size``: one worker actor per
    (stage, rank) in one placement group (``placement_strategy``), driven by a scheduler actor. It joins
    the Ray cluster at ``RAY_ADDRESS`` (or one this process already joined), else starts a local one.
    """

    def __init__(self, model: str | Transformer = "tiny", *, distributed: str = "local", **kwargs):
        self._live: Engine | None = None
        built = model if isinstance(model, Transformer) else None
        config = EngineConfig(model="" if built else model, distributed=distributed, **kwargs)
        if distributed == "ray":
            if built is not None:
                raise ValueError("distributed='ray' builds the model in its worker actors: pass a preset or a directory")
            from cluster.ray_engine import RayEngine

            self._live = RayEngine(config)
            self.tokenizer = self._engine.tokenizer
            self.max_model_len = self._engine.max_model_len
            return
        from cluster.config import model_config

        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        engine_plan = plan(config, built.config if built else model_config(model), device)
        self.tokenizer = load_tokenizer(config.model, engine_plan.model.eos_token_ids, config.tokenizer,
                                        config.chat_template)
        self.max_model_len = engine_plan.max_model_len
        executor = LocalExecutor(engine_plan, built)
        try:
            self._live = EngineCore(executor.plan, executor, self.tokenizer)
        except BaseException:
            executor.close()
            raise

    @property
    def _engine(self) -> Engine:
        if self._live is None:
            raise EngineDeadError("this LLM was closed: start a new one")
        return self._live

    @property
    def plan(self) -> EnginePlan:
        """The engine's resolved configuration: attention, graphs, workers, scheduler."""
        return self._engine.plan

    # -- in-process access (benchmarks, tests) -------------------------------------------------
    @property
    def core(self) -> EngineCore:
        """The in-process engine core (``distributed="local"`` only)."""
        engine = self._engine
        if not isinstance(engine, EngineCore):
            raise AttributeError("the engine core runs in the Ray scheduler actor: there is no in-process core")
        return engine

    @property
    def cache(self):
        """The in-process worker's KV cache."""
        return self.core.executor.worker.cache

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def last_step(self):
        return self.core.last_step

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One scheduling step of the in-process engine (see ``EngineCore.step``)."""
        return self.core.step(finished_only)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        """Queue a prompt (text or token ids); returns its request id. Bad input raises ``ValueError``
        naming the field and leaves the engine serving the other requests."""
        return self._engine.add_requests([prompt], [params])[0]

    def abort(self, request_id: str) -> None:
        """Stop a request now; its memory is freed. Its ``generate``/``stream`` ends it with
        ``finish_reason="abort"`` (text so far kept); an unknown or finished id is ignored."""
        self._engine.abort(request_id)

    def snapshot(self) -> EngineSnapshot:
        """KV memory per worker, queue sizes and per-request progress."""
        return self._engine.snapshot()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix and give its memory back (vLLM's call); the number of blocks dropped.
        Running requests keep the blocks they hold."""
        return self._engine.reset_prefix_cache()

    def start_profile(self, directory: str | os.PathLike) -> None:
        """Record every worker's steps under torch's profiler (CPU and CUDA activity, each step a range named
        ``vattn_step_prefill(P)_decode(D)_seqs(S)``) until ``stop_profile`` (vLLM's calls). Each worker writes
        ``directory/vattn_pp{P}_tp{T}.pt.trace.json.gz`` on its own host; ``bench/trace_breakdown.py`` splits one
        into steps and kernels by kind. Raises ``RuntimeError`` while already recording."""
        self._engine.start_profile(os.fspath(directory))

    def stop_profile(self) -> list[str]:
        """Stop recording and write the traces; their paths, one per worker (pp-major). Raises ``RuntimeError``
        when not recording."""
        return self._engine.stop_profile()

    def generate(self, prompts: Prompts, sampling_params: ParamsArg = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        finals = {o.request_id: o for o in self._run(prompts, sampling_params, use_tqdm, finished_only=True)}
        return [finals[i] for i in sorted(finals, key=int)]

    def stream(self, prompts: Prompts, sampling_params: ParamsArg = None, use_tqdm: bool = False) -> Iterator[RequestOutput]:
        """Yield a RequestOutput each time a request gains tokens, the last with ``finished=True``."""
        return self._run(prompts, sampling_params, use_tqdm, finished_only=False)

    def _run(self, prompts: Prompts, sampling_params: ParamsArg, use_tqdm: bool, finished_only: bool) -> Iterator[RequestOutput]:
        one = isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int))
        batch = [prompts] if one else list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"{len(params)} sampling_params for {len(batch)} prompts")
        pending = set(self._engine.add_requests(batch, list(params), stream=not finished_only))
        with tqdm(total=len(pending), desc="generating", disable=not use_tqdm) as bar:
            while pending:
                for o in self._engine.poll(pending, finished_only):
                    if o.request_id in pending:
                        yield o
                        if o.finished:
                            pending.discard(o.request_id)
                            bar.update(1)

    def close(self) -> None:
        """Stop the workers and give the KV memory back (Ray: no actor or placement group is left). Once."""
        if self._live is not None:
            engine, self._live = self._live, None
            engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
