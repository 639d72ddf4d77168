"""OutputCollector: the ingress replica's side of its requests' outputs.

A request goes to an engine replica (Serve routes the call), which queues it on its scheduler actor and names
that actor. From then on the ingress polls the actor itself: one task per scheduler actor asks for the newest
output of every request this ingress replica has there, and hands each to its call's queue. A step's tokens for
all of an ingress's streams cost one actor call, not one Serve stream item per stream per token; under load a
poll simply returns bigger outputs (outputs are cumulative), so a slow ingress falls behind by nothing.

Where the engine deployment has one replica there is nothing to route: the ingress sends its calls to that replica's
scheduler actor itself, once a call through Serve named it. That takes two hops off every request's way in (the
handle's call through Serve's router, and the replica's to its scheduler): on the 2-core CPU box, one client's TTFT
p50 went from 19.5 to 12.4 ms (``bench/results/serving_direct_ab_cpu.json``). A scheduler that is gone, failed or
draining (its replica being stopped in a rolling update) sends the call back to Serve, which knows the replica that
replaced it. Calls for that scheduler that come while one is on its way go together in the next actor call
(``SchedulerActor.add_many``): a burst of requests, as when many clients start at once, costs the step loop's process a
few calls, not one each (``bench/add_burst.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray

from cluster.errors import EngineDeadError, EngineDrainingError
from cluster.outputs import RequestOutput
from cluster.scheduler_actor import AddCall
from server.engine import SchedulerRef
from worker.sampling import SamplingParams
from worker.tokenizer import Tokenizer

#: Seconds one poll waits for outputs before it asks again (a poll returns as soon as any request moves).
POLL_S = 1.0
#: Times a call is sent again after the engine replica it went to was stopping, gone or dead (each time through Serve).
ADD_RETRIES = 3
#: Seconds before the first such call through Serve again, doubling after each (Serve's router may not have heard yet
#: that the replica it chose is stopping).
ADD_BACKOFF_S = 0.05


@dataclass(frozen=True)
class Progress:
    """One request of a call moved on."""

    index: int  # which of the call's prompts
    output: RequestOutput


class OutputCollector:
    """Sends calls to the engine deployment (``engine``: a Serve handle) and collects their outputs; ``consumer``:
    this ingress replica's name at the scheduler actors; ``tokenizer`` and ``vocab_size``: the engine's, to tokenize
    prompts and chats here and decode token ids; ``direct``: the deployment has one replica, whose scheduler actor takes
    the calls once one through Serve named it."""

    def __init__(self, engine, consumer: str, tokenizer: Tokenizer, vocab_size: int, direct: bool = False):
        self.engine, self.consumer, self.direct = engine, consumer, direct
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._scheduler: SchedulerRef | None = None  # the one replica's, while it takes calls
        self._queues: dict[str, asyncio.Queue] = {}
        self._live: dict[str, set[str]] = {}  # scheduler name -> requests of this ingress there
        self._pollers: dict[str, asyncio.Task] = {}
        # Per direct scheduler: the calls that came while one was on its way, sent together next (``_send_adds``).
        self._adds: dict[str, list[tuple[AddCall, asyncio.Future]]] = {}
        self._senders: dict[str, asyncio.Task] = {}

    async def generate(self, prompts: list, params: SamplingParams, stream: bool, chat: list[dict] | None = None,
                       cache_salt: str | None = None, tools: list[dict] | None = None) -> AsyncIterator[list[Progress]]:
        """The call's requests' outputs as they progress (``stream``) or once at their end, in batches: all that
        arrived since the caller last looked, each request's newest only. ``chat``: messages to put through the
        model's chat template instead of ``prompts``; ``cache_salt``: the prefix cache's (see ``EngineCore.prepare``).
        Bad input raises ``ValueError`` before anything is queued.
        Closing the generator early aborts the requests still running (their memory is freed at once)."""
        received = time.time()  # the way to the engine starts here (``AddCall.received``)
        prompts = await self.tokenized(prompts, chat, tools)
        ids = [uuid.uuid4().hex for _ in prompts]
        queue: asyncio.Queue = asyncio.Queue()
        for i in ids:
            self._queues[i] = queue  # before the call: the first output may come before it returns
        index = {request_id: k for k, request_id in enumerate(ids)}
        live, scheduler = set(ids), None
        try:
            scheduler = await self._add(AddCall(prompts, params, stream, tuple(ids), self.consumer, cache_salt,
                                                received))
            self._live.setdefault(scheduler.name, set()).update(ids)
            self._poll(scheduler)
            while live:
                newest: dict[str, RequestOutput] = {}
                out = await queue.get()
                while True:
                    if isinstance(out, BaseException):
                        raise out
                    newest[out.request_id] = out
                    if queue.empty():
                        break
                    out = queue.get_nowait()
                live.difference_update(i for i, o in newest.items() if o.finished)
                yield [Progress(index[i], o) for i, o in newest.items()]
        finally:
            for i in ids:
                self._queues.pop(i, None)
            if scheduler is not None:
                self._live.get(scheduler.name, set()).difference_update(ids)
                # The caller went away (or the engine failed): free their memory now. From a context of its own:
                # when Serve cancels a request (its client gone) Ray also cancels the calls the request made, and
                # an abort sent from the request's context is cancelled with it if it has not run yet.
                contextvars.Context().run(_abort, scheduler, live)

    async def tokenized(self, prompts: list, chat: list[dict] | None = None, tools: list[dict] | None = None) -> list:
        """``token_ids``, on a thread where there is text: a burst of text prompts (a closed loop's clients all at
        once) would otherwise hold up the burst's other requests, and every stream's tokens, behind each one's
        tokenizing on the event loop."""
        if chat is None and not any(isinstance(p, str) for p in prompts):
            return prompts
        return await asyncio.to_thread(self.token_ids, prompts, chat, tools)

    def token_ids(self, prompts: list, chat: list[dict] | None = None, tools: list[dict] | None = None) -> list:
        """The prompts as the engine would tokenize them (a chat through the template, which may refuse it with a
        ``ValueError``): text costs the step loop's process nothing then. Token ids as given; the engine checks them."""
        if chat is not None:
            prompts = [self.tokenizer.apply_chat_template(chat, tools)]
        texts = iter(self.tokenizer.encode_batch([p for p in prompts if isinstance(p, str)]))
        return [next(texts) if isinstance(p, str) else p for p in prompts]

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens``; a ``ValueError`` naming the ids outside the vocabulary."""
        if bad := [t for t in tokens if not 0 <= t < self.vocab_size]:
            raise ValueError(f"tokens {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        return self.tokenizer.decode(tokens)

    async def _add(self, call: AddCall) -> SchedulerRef:
        """Queue ``call`` on the scheduler that takes calls directly, else through Serve. Sent again (through Serve)
        where the replica it went to is being stopped, or the direct scheduler is gone or dead: none of the call's
        requests was queued then."""
        retries = 0
        while True:
            direct = self._scheduler
            try:
                if direct is not None:
                    await self._add_direct(direct, call)
                    return direct
                scheduler = await self.engine.add.remote(call)
            except Exception as exc:
                cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
                elsewhere = isinstance(cause, EngineDrainingError) or (direct is not None and isinstance(cause, _GONE))
                if retries == ADD_RETRIES or not elsewhere:
                    raise
                retries += 1
                if direct is None:
                    await asyncio.sleep(ADD_BACKOFF_S * 2 ** (retries - 1))
                elif self._scheduler is direct:  # not one another call learned since
                    self._scheduler = None
                continue
            if self.direct:
                self._scheduler = scheduler
            return scheduler

    async def _add_direct(self, direct: SchedulerRef, call: AddCall) -> None:
        """``call`` queued on ``direct``'s scheduler actor, with the calls that come meanwhile: one actor call carries
        all that wait (``SchedulerActor.add_many``), so that a burst of requests costs the step loop's process a few
        calls, not one each. Raises what queueing this call raised."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._adds.setdefault(direct.name, []).append((call, future))
        sender = self._senders.get(direct.name)
        if sender is None or sender.done():
            # In a context of its own, as the pollers: a request cancelled (its client gone) must not cancel the others'.
            self._senders[direct.name] = loop.create_task(self._send_adds(direct), context=contextvars.Context())
        await future

    async def _send_adds(self, direct: SchedulerRef) -> None:
        while batch := self._adds.pop(direct.name, None):
            try:
                errors = await direct.actor.add_many.remote([call for call, _ in batch])
            except Exception as exc:  # the actor gone or dead: every call of the batch hears of it
                errors = [exc] * len(batch)
            for (call, future), error in zip(batch, errors, strict=True):
                if future.cancelled():  # its caller went away while the call was on its way: nobody reads them
                    if error is None:
                        _abort(direct, set(call.request_ids))
                elif error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(None)

    def _poll(self, scheduler: SchedulerRef) -> None:
        task = self._pollers.get(scheduler.name)
        if task is None or task.done():
            # In a context of its own: Ray cancels the calls a request made when the request is cancelled (a
            # client gone), and this task's calls serve every request.
            self._pollers[scheduler.name] = asyncio.get_running_loop().create_task(
                self._collect(scheduler), context=contextvars.Context())

    async def _collect(self, scheduler: SchedulerRef) -> None:
        while self._live.get(scheduler.name):
            try:
                outputs = await scheduler.actor.wait_outputs.remote(None, POLL_S, self.consumer)
            except ray.exceptions.TaskCancelledError:
                continue  # not the engine's failure: ask again
            except Exception as exc:  # the engine (or its replica) is dead: each of its requests hears why
                error = exc.cause if isinstance(getattr(exc, "cause", None), EngineDeadError) else exc
                for i in self._live.pop(scheduler.name, set()):
                    if (queue := self._queues.get(i)) is not None:
                        queue.put_nowait(error)
                return
            for out in outputs:
                if (queue := self._queues.get(out.request_id)) is not None:  # else aborted: nobody waits
                    queue.put_nowait(out)


#: A direct scheduler that can take no call: its engine failed for good, or its actor is gone.
_GONE = (EngineDeadError, ray.exceptions.RayActorError)


def _abort(scheduler: SchedulerRef, request_ids: set[str]) -> None:
    for i in request_ids:
        scheduler.actor.abort.remote(i)
