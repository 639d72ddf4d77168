"""``SchedulerActor``: runs the engine core's step loop over the worker actors (``RayExecutor``) and buffers outputs
for its clients."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import ray

from cluster.config import EngineConfig, model_config, plan
from cluster.engine_core import EngineCore, Prompt
from cluster.errors import EngineDeadError, EngineDrainingError, WorkerGroupError
from cluster.outputs import RequestOutput
from cluster.ray_executor import RayExecutor
from cluster.telemetry import POLL_BUCKETS, TTFT_BUCKETS, EngineSnapshot, Histogram
from kvmem.stats import PageMap, SlotAccounting
from worker.heap import freeze_heap
from worker.sampling import SamplingParams
from worker.tokenizer import load_tokenizer


#: Seconds a finished request's output waits for its client before it is dropped (a client that went away).
UNCLAIMED_OUTPUT_S = 300.0
#: Histograms a scheduler actor adds to its engine's snapshot: seconds from a request's HTTP front taking it in to this
#: actor queueing it (``AddCall.received``), and from its first token's output being buffered here to a client's poll
#: taking it (with the engine's own TTFT they split what a client sees); and how many step outputs of a stream a poll
#: took at once (1 while the polls keep up with the steps; k: its tokens went on to the client k steps at a time).
PATH_HISTOGRAMS = {"request_ingress_seconds": TTFT_BUCKETS, "first_token_pickup_seconds": TTFT_BUCKETS,
                   "stream_outputs_per_poll": POLL_BUCKETS}

# The calls every request and every step make send no task events to the GCS. It keeps the last 100,000 tasks'
# events: serving tiny on CPU (bench/soak.py) it grew from 245 to 363 MiB over the first 20 minutes, to that cap.
hot = ray.method(enable_task_events=False)


@dataclass(frozen=True)
class AddCall:
    """One API call's requests, as its client sends them to a scheduler actor (``SchedulerActor.add``): ``prompts``
    (token ids, or text), all under ``params``, queued under the caller's ``request_ids``; their outputs go to
    ``consumer``'s polls. ``cache_salt``: the prefix cache's (``EngineCore.prepare``). The HTTP ingress sends token ids,
    chats already through the model's template: text costs the step loop's process nothing."""

    prompts: list
    params: SamplingParams
    stream: bool
    request_ids: tuple[str, ...]
    consumer: str
    cache_salt: str | None = None
    received: float | None = None  # when the client took the requests in (``time.time()``): the way in is measured

    def engine_prompts(self) -> list[Prompt]:
        """What ``EngineCore.prepare`` takes: the salt beside each prompt."""
        if self.cache_salt is None:
            return self.prompts
        return [{"prompt" if isinstance(p, str) else "prompt_token_ids": p, "cache_salt": self.cache_salt}
                for p in self.prompts]


@ray.remote(num_cpus=0)
class SchedulerActor:
    """Owns the engine core (scheduler, page ledger, requests, telemetry) and runs its step loop on a
    thread; clients add requests and wait for outputs through the methods below (a threaded actor)."""

    def __init__(self, config: EngineConfig, placement=None):
        """``placement``: a ``cluster.ray_executor.Placement`` for the workers (else they get their own group)."""
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._core_lock = threading.Lock()
        self._inbox: list[tuple[str, object]] = []
        self._outputs: dict[str, list[RequestOutput]] = {}
        self._streamed: set[str] = set()
        self._consumers: dict[str, set[str]] = {}  # consumer -> the live requests it added
        self._unclaimed: dict[str, float] = {}  # finished request -> when its final output was buffered
        self._rebuilding = False
        self._draining = False
        # A request's way from its HTTP front to the engine, and its first token's from the engine to a client's poll:
        # the serving path's share of TTFT, which the engine's own histograms do not see (``PATH_HISTOGRAMS``).
        self._path = {name: Histogram(bounds) for name, bounds in PATH_HISTOGRAMS.items()}
        self._made: dict[str, float | None] = {}  # request -> when its first token's output was buffered; None: taken
        try:
            engine_plan = plan(config, model_config(config.model), config.device)
            tokenizer = load_tokenizer(config.model, engine_plan.model.eos_token_ids, config.tokenizer,
                                       config.chat_template)
            executor = RayExecutor(engine_plan, placement=placement)
            try:
                self.core = EngineCore(executor.plan, executor, tokenizer)
            except BaseException:
                executor.close()  # no worker outlives a failed start
                raise
        except BaseException as exc:  # raised to the client by ready(), which then kills this actor
            self._error = exc
            return
        freeze_heap("scheduler actor")  # this process is the engine's
        self._thread = threading.Thread(target=self._loop, name="vattn-step-loop", daemon=True)
        self._thread.start()

    def ready(self) -> tuple[int, tuple[int, ...]]:
        """(max_model_len, eos token ids) once the workers are up; the construction error otherwise."""
        if self._error is not None:
            raise self._error
        return self.core.max_model_len, tuple(self.core.tokenizer.eos_token_ids)

    # -- clients -------------------------------------------------------------------------------
    @hot
    def add(self, call: AddCall) -> None:
        """``add_requests`` for one API call; an ``EngineDrainingError`` once ``drain`` was called."""
        self._check_alive()
        prompts = call.engine_prompts()
        self.add_requests(prompts, [call.params] * len(prompts), call.stream, list(call.request_ids), call.consumer)
        if call.received is not None:  # the client's clock: another host's, maybe a little apart
            way_in = max(0.0, time.time() - call.received)
            with self._cond:
                for _ in call.request_ids:
                    self._path["request_ingress_seconds"].observe(way_in)

    @hot
    def add_many(self, calls: list[AddCall]) -> list[BaseException | None]:
        """``add`` for each of ``calls`` (an ingress's calls that came while its last one was on its way: one actor
        call for all of them); each call's error in its place, None where it was queued. A burst of 256 one-request calls
        was queued after 208 ms one call each and 23 ms in one (``bench/results/add_burst_cpu.json``), all of it beside
        the step loop."""
        errors: list[BaseException | None] = []
        for call in calls:
            try:
                self.add(call)
                errors.append(None)
            except Exception as exc:  # that call's own: bad input, or the engine draining or dead
                errors.append(exc)
        return errors

    @hot
    def add_requests(self, prompts: list[Prompt], params: list[SamplingParams | None], stream: bool = False,
                     request_ids: list[str] | None = None, consumer: str | None = None) -> list[str]:
        """Validate all (a ``ValueError`` queues none), queue them for the loop; their ids (``request_ids``: the
        caller's, which must not be in use -- so it can wait for outputs before it knows they were queued).
        ``consumer``: a name whose ``wait_outputs`` call returns these requests' outputs with its others'."""
        self._check_alive()
        ids = request_ids or [None] * len(prompts)
        prepared = [self.core.prepare(p, sp, i) for p, sp, i in zip(prompts, params, ids, strict=True)]
        with self._cond:
            if self._closed:
                raise EngineDeadError("the engine is shutting down: no new requests")
            if self._draining:
                raise EngineDrainingError("this engine replica is being stopped: it takes no new requests")
            taken = [r.request_id for r in prepared if r.request_id in self._outputs]
            if taken or len({r.request_id for r in prepared}) < len(prepared):
                raise ValueError(f"request ids in use or repeated: {taken or ids}")
            for r in prepared:
                self._outputs[r.request_id] = []
                if stream:
                    self._streamed.add(r.request_id)
                if consumer is not None:
                    self._consumers.setdefault(consumer, set()).add(r.request_id)
                self._inbox.append(("add", r))
            self._cond.notify_all()
        return [r.request_id for r in prepared]

    @hot
    def abort(self, request_id: str) -> None:
        with self._cond:
            self._inbox.append(("abort", request_id))
            self._cond.notify_all()

    @hot
    def wait_outputs(self, request_ids: list[str] | None, timeout: float = 1.0,
                     consumer: str | None = None) -> list[RequestOutput]:
        """The newest output of each of ``request_ids`` (None: of ``consumer``'s requests, or of every request
        without one) that moved since the last call -- outputs are cumulative, so one that waited long says all
        the ones before it did -- waiting up to ``timeout`` s for the first. An id this actor does not know
        (never added, or its output expired uncollected) gets a final error output. A ``consumer``'s outputs
        carry the prompt (text and token ids) in the final one only: they are most of what a poll would send each step
        (256 streams of 1000-token prompts: 754 KB and 6.4 ms to pickle a poll, against 51 KB and 1.2 ms); those of
        requests that asked for prompt logprobs carry it throughout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            unknown = [i for i in request_ids or () if i not in self._outputs]
            if unknown:
                return [RequestOutput.failed(i, f"unknown request {i!r}, or its output was not collected within "
                                                f"{UNCLAIMED_OUTPUT_S:.0f} s of its end") for i in unknown]
            while not any(self._outputs.get(i) for i in self._selected(request_ids, consumer)):
                if self._error is not None and isinstance(self._error, EngineDeadError):
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            out, now = [], time.monotonic()
            for i in list(self._selected(request_ids, consumer)):
                if self._outputs.get(i):
                    newest = self._outputs[i][-1]
                    if i in self._streamed:
                        self._path["stream_outputs_per_poll"].observe(len(self._outputs[i]))
                    self._outputs[i] = []
                    if (made := self._made.get(i)) is not None:
                        self._path["first_token_pickup_seconds"].observe(now - made)
                        self._made[i] = None
                    if newest.finished:
                        self._forget(i)
                    elif consumer is not None and newest.prompt_logprobs is None:  # an echo's logprobs need them
                        newest = replace(newest, prompt=None, prompt_token_ids=())
                    out.append(newest)
            return out

    def _selected(self, request_ids: list[str] | None, consumer: str | None):
        # Looked up at each wake: a request its consumer added while it waited counts.
        if request_ids is not None:
            return request_ids
        return self._consumers.get(consumer, ()) if consumer is not None else self._outputs

    def _forget(self, request_id: str) -> None:
        del self._outputs[request_id]
        self._streamed.discard(request_id)
        self._unclaimed.pop(request_id, None)
        self._made.pop(request_id, None)
        for consumer, ids in list(self._consumers.items()):
            ids.discard(request_id)
            if not ids:
                del self._consumers[consumer]

    def drain(self) -> None:
        """Take no new requests from now on (they get ``EngineDrainingError``); those held run to their ends."""
        with self._cond:
            self._draining = True

    @hot
    def in_flight(self) -> int:
        """Requests added and not yet done with: running, waiting, or finished with their final output not collected
        (what a replica being stopped waits for)."""
        with self._cond:
            return len(self._outputs)

    @hot
    def health(self) -> str:
        """"ok", "rebuilding" (the worker group failed and is being replaced), "draining" (its replica is being
        stopped: it finishes what it holds, takes nothing new) or "dead" (the engine cannot serve)."""
        if self._error is not None or self._closed:
            return "dead"
        return "rebuilding" if self._rebuilding else "draining" if self._draining else "ok"

    @hot
    def snapshot(self) -> EngineSnapshot:
        """The engine core's, with this actor's ``PATH_HISTOGRAMS``."""
        with self._core_lock:
            snapshot = self.core.snapshot()
        with self._cond:
            path = {name: h.copy() for name, h in self._path.items()}
        return replace(snapshot, histograms=snapshot.histograms | path)

    def page_maps(self) -> dict[tuple[int, int], PageMap]:
        """Every worker's page map, by (pp_rank, tp_rank): what /dashboard draws."""
        with self._core_lock:
            maps = self.core.executor.page_maps()
            return {(w.pp_rank, w.tp_rank): m for w, m in zip(self.core.plan.workers, maps, strict=True)}

    def reset_prefix_cache(self) -> int:
        """``EngineCore.reset_prefix_cache`` between steps."""
        self._check_alive()
        with self._core_lock:
            return self.core.reset_prefix_cache()

    def start_profile(self, directory: str) -> None:
        """``EngineCore.start_profile`` between steps."""
        self._check_alive()
        with self._core_lock:
            self.core.start_profile(directory)

    def stop_profile(self) -> list[str]:
        """``EngineCore.stop_profile`` between steps."""
        self._check_alive()
        with self._core_lock:
            return self.core.stop_profile()

    def worker_accounting(self) -> list[SlotAccounting]:
        """Every worker's slot accounting, and the ledger's last (tests check they agree)."""
        with self._core_lock:
            return self.core.executor.accounting() + [self.core.ledger.accounting()]

    def shutdown(self) -> None:
        """Stop the loop and the workers; nothing is left in the cluster but this actor (kill it next)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._error is None or isinstance(self._error, EngineDeadError):
            self._thread.join()
            with self._core_lock:
                self.core.close()

    # -- the loop ------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._inbox and not self.core.has_work:
                    self._cond.wait()
                if self._closed:
                    return
                inbox, self._inbox = self._inbox, []
            with self._core_lock:
                try:
                    outputs = self._step(inbox)
                except BaseException as exc:  # clients wait on this thread: they hear of its end
                    self._error = EngineDeadError(f"the engine's step loop failed: {type(exc).__name__}: {exc}")
                    outputs = self.core.fail_all(str(self._error))
            with self._cond:
                self._deliver(outputs)
                self._cond.notify_all()
            if self._error is not None:
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for o in outputs:
            if o.request_id in self._outputs:
                self._outputs[o.request_id].append(o)
                if o.request_id not in self._made and any(c.token_ids for c in o.outputs):
                    self._made[o.request_id] = now
                if o.finished:
                    self._unclaimed[o.request_id] = now
        for request_id, since in list(self._unclaimed.items()):
            if now - since > UNCLAIMED_OUTPUT_S:
                self._forget(request_id)

    def _step(self, inbox: list[tuple[str, object]]) -> list[RequestOutput]:
        handled = 0
        try:
            for kind, item in inbox:
                if kind == "add":
                    self.core.add(item)
                else:
                    self.core.abort(item)  # its final output comes with the step's
                handled += 1
            return self.core.step(finished_only=True, streamed=self._streamed)
        except Exception as exc:  # the loop thread must live on: clients wait on it
            # Requests the core never queued are ended here; it ends the ones it knows.
            known = self.core.requests
            outputs = [self.core.refused(r, f"the engine failed before queueing it: {exc}")
                       for kind, r in inbox[handled:] if kind == "add" and r.request_id not in known]
            self._rebuilding = True
            try:
                # A worker's failure spares the requests that had not started; any other error may come from
                # one of them, so all go.
                return outputs + self.core.recover(exc, keep_waiting=isinstance(exc, WorkerGroupError))
            except Exception as fatal:
                self._error = EngineDeadError(f"the engine failed ({exc}) and could not be rebuilt: {fatal}")
                return outputs + self.core.fail_all(str(self._error))
            finally:
                self._rebuilding = False

