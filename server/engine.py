"""EngineServer: one engine replica of the Serve application -- a scheduler actor and its worker actors --
streaming each request's outputs to the ingress.

One task per replica collects the scheduler actor's outputs for all its requests and hands each to its
request's queue; a request whose caller goes away (a client that disconnected) is aborted at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray import serve

from cluster.config import EngineConfig
from cluster.errors import EngineDeadError
from cluster.outputs import RequestOutput
from cluster.ray_engine import RayEngine
from cluster.ray_executor import Placement
from cluster.telemetry import EngineSnapshot
from worker.sampling import SamplingParams


#: Scheduler actors of engine replicas are named this and the replica's id (the metrics endpoint finds them).
SCHEDULER_PREFIX = "vattn-scheduler-"


@dataclass(frozen=True)
class Progress:
    """One request of a call moved on."""

    index: int  # which of the call's prompts
    output: RequestOutput
    token_texts: dict[int, str]  # the text of every token its logprobs name (final outputs with logprobs only)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int


class EngineServer:
    """The engine deployment's replica (``server.app`` wraps it in ``serve.deployment``)."""

    def __init__(self, config: EngineConfig, model_name: str):
        # The replica's placement group (Serve made it from ``placement_group_bundles``): bundle 0 holds this replica
        # and its scheduler actor, the rest its workers -- so Serve places a replica only where its GPUs are free.
        group = ray.util.get_current_placement_group()
        replica = serve.get_replica_context().replica_id.unique_id
        self.engine = RayEngine(config, Placement(group) if group is not None else None, SCHEDULER_PREFIX + replica)
        self.info = ModelInfo(model_name, self.engine.max_model_len)
        self._queues: dict[str, asyncio.Queue] = {}
        self._collector: asyncio.Task | None = None

    async def generate(self, prompts: list, params: SamplingParams, stream: bool,
                       chat: list[dict] | None = None) -> AsyncIterator[Progress]:
        """Each request's outputs as it progresses (``stream``) or once at its end; ``chat``:
        messages to put through the model's chat template instead of ``prompts``. Bad input raises
        ``ValueError`` before anything is queued."""
        if chat is not None:
            prompts = [self.engine.tokenizer.apply_chat_template(chat)]
        ids = [uuid.uuid4().hex for _ in prompts]
        queue: asyncio.Queue = asyncio.Queue()
        for i in ids:
            self._queues[i] = queue
        index = {request_id: k for k, request_id in enumerate(ids)}
        live = set(ids)
        try:
            await self.engine.actor.add_requests.remote(prompts, [params] * len(prompts), stream, ids)
            self._collect()
            while live:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    live.discard(out.request_id)
                # Only final outputs carry logprobs to the client: decoding every streamed one would be wasted.
                texts = self._token_texts(out) if params.logprobs is not None and out.finished else {}
                yield Progress(index[out.request_id], out, texts)
        finally:
            for i in ids:
                self._queues.pop(i, None)
            for i in live:  # the caller went away (or the engine failed): free their memory now
                self.engine.actor.abort.remote(i)

    def _token_texts(self, out: RequestOutput) -> dict[int, str]:
        decode = self.engine.tokenizer.decode
        ids = {t.token_id for c in out.outputs for t in c.logprobs or ()}
        ids |= {i for c in out.outputs for t in c.logprobs or () for i in t.top_logprobs or {}}
        return {i: decode([i]) for i in ids}

    def _collect(self) -> None:
        if self._collector is None or self._collector.done():
            # In a context of its own: Ray cancels the calls a request made when the request is cancelled (a
            # client gone), and this task's calls serve every request.
            self._collector = asyncio.get_running_loop().create_task(self._collect_outputs(), context=contextvars.Context())

    async def _collect_outputs(self) -> None:
        while self._queues:
            try:
                outputs = await self.engine.actor.wait_outputs.remote(None, 1.0)
            except ray.exceptions.TaskCancelledError:
                continue  # not the engine's failure: ask again
            except Exception as exc:  # the engine is dead: every waiting request hears why
                error = exc.cause if isinstance(getattr(exc, "cause", None), EngineDeadError) else exc
                for queue in set(self._queues.values()):
                    queue.put_nowait(error)
                return
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:  # else an abort's final output: nobody waits for it
                    queue.put_nowait(out)

    async def health(self) -> str:
        """"ok", "rebuilding" or "dead" (see ``SchedulerActor.health``)."""
        return await self.engine.actor.health.remote()

    async def model_info(self) -> ModelInfo:
        return self.info

    async def snapshot(self) -> EngineSnapshot:
        return await self.engine.actor.snapshot.remote()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
