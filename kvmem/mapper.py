"""AsyncMapper: map the pages of step k+1 on a background thread while step k computes."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from torch.profiler import record_function

from kvmem.errors import KVCacheError
from kvmem.slots import SlotCache


@dataclass(eq=False)
class MappingPlan:
    """What the next step needs: slot -> tokens it must hold (each an ``ensure``), then optionally free slots given
    pages for requests about to arrive: ``SlotCache.eager_map(eager_tokens, eager_slots, eager_pages, eager_drop)``,
    then waiting requests' cached prefixes mapped into free slots: ``SlotCache.map_prefixes_ahead(prefixes)`` (None:
    none; empty: the slots kept for them before are let go)."""

    needs: dict[int, int]
    eager_tokens: int = 0
    eager_slots: int = 0
    eager_pages: int | None = None
    eager_drop: tuple[int, ...] = ()
    prefixes: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    _items: list[tuple[str, tuple]] = field(init=False, repr=False)  # (the cache's method, its arguments)
    _next: int = field(default=0, init=False, repr=False)  # items started
    _errors: list[BaseException] = field(default_factory=list, init=False, repr=False)
    # Held while an item runs: one at a time, in the plan's order, whichever thread runs it -- an ensure may reclaim
    # pages, and every worker must reclaim the ones its scheduler's ledger did, in the ledger's order.
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self._items = [("ensure", need) for need in self.needs.items()]
        if self.eager_slots:
            self._items.append(("eager_map", self.eager_args))
        if self.prefixes is not None:
            self._items.append(("map_prefixes_ahead", (self.prefixes,)))
        if not self._items:
            self._done.set()

    @property
    def eager_args(self) -> tuple:
        """``SlotCache.eager_map``'s arguments, as a step carries them to the workers (``StepInput.eager``); () for
        none."""
        return (self.eager_tokens, self.eager_slots, self.eager_pages, self.eager_drop) if self.eager_slots else ()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _run_next(self, cache: SlotCache) -> bool:
        """Run the next item; False when none is left."""
        with self._lock:
            index = self._next
            if index >= len(self._items):
                return False
            self._next += 1
            name, args = self._items[index]
            try:
                getattr(cache, name)(*args)
            except BaseException as exc:  # surfaces in wait(); never lost in the thread
                self._errors.append(exc)
            if self._next == len(self._items):
                self._done.set()
            return True


@dataclass(eq=False)
class Cleanup:
    """A ``SlotCache.unmap_stale`` queued on the mapper thread (``AsyncMapper.clean``); ``done`` once it ran."""

    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class Drain:
    """Queued behind everything else: set once the thread reached it."""

    done: threading.Event = field(default_factory=threading.Event)


class AsyncMapper:
    """One persistent thread that executes ``MappingPlan``s against a cache, and undoes the mappings of pages let go of
    (``clean``) while nothing else needs the cache.

    ``submit`` returns at once; ``wait`` runs whatever of the plan the thread has not started itself,
    then waits for what is in flight. Only that wait counts as stall time (``cache.stats().stall_seconds``).
    An error in a plan is raised by ``wait``; one never waited for is raised by ``close``.
    """

    def __init__(self, cache: SlotCache):
        self._cache = cache
        self._queue: queue.SimpleQueue[MappingPlan | Cleanup | Drain | None] = queue.SimpleQueue()
        self._unobserved: set[MappingPlan] = set()
        self._cleanup: Cleanup | None = None  # queued and not started: another clean() joins it
        self._clean_error: BaseException | None = None
        self._nothing_stale = threading.Event()  # what clean() returns with nothing to unmap: done at once
        self._nothing_stale.set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvmem-mapper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, Drain):
                item.done.set()
                continue
            if isinstance(item, Cleanup):
                self._cleanup = None  # a clean() from now on queues one more: these pages may be done with by then
                try:
                    with record_function("kvmem_unmap_stale"):
                        self._cache.unmap_stale()
                except BaseException as exc:  # raised by the next clean(); never lost in the thread
                    self._clean_error = exc
                item.done.set()
                continue
            # A range in a profiler's trace (``LLM.start_profile``): when the driver's mapping calls run beside the
            # launching thread's, whose driver calls they can hold up
            with record_function("kvmem_map_ahead"):
                while item._run_next(self._cache):
                    pass

    def clean(self) -> threading.Event:
        """Queue ``cache.unmap_stale`` (for a cache whose ``unmaps_in_background``), after the plans queued before it;
        the event is set once it ran (at once where no slot keeps stale mappings). A clean queued and not started yet is
        joined, not queued again."""
        if self._closed:
            raise KVCacheError("AsyncMapper is closed")
        if self._clean_error is not None:
            raise self._clean_error
        if not self._cache.has_stale:  # a decode step's usual case: no queue put, no thread woken, nothing made
            return self._nothing_stale
        cleanup = self._cleanup
        if cleanup is None:
            cleanup = self._cleanup = Cleanup()
            self._queue.put(cleanup)
        return cleanup.done

    def submit(self, plan: MappingPlan) -> MappingPlan:
        """Queue ``plan`` for the mapper thread; returns it for ``wait``."""
        if self._closed:
            raise KVCacheError("AsyncMapper is closed")
        self._unobserved = {p for p in self._unobserved if not p.done or p._errors}
        self._unobserved.add(plan)
        self._queue.put(plan)
        return plan

    def drain(self) -> None:
        """Return once the thread has run every plan and cleanup queued so far: until the next ``submit`` or ``clean``
        it makes no driver call (a CUDA graph's capture must meet none from another thread). A plan's error is still
        raised by its ``wait``."""
        if self._closed:
            raise KVCacheError("AsyncMapper is closed")
        drain = Drain()
        self._queue.put(drain)
        drain.done.wait()

    def wait(self, plan: MappingPlan, record: bool = True) -> float:
        """Return once every page of ``plan`` is mapped; raises the plan's first error. Returns the seconds
        waited, which count as stall unless ``record`` is False (a caller that knows the wait was hidden)."""
        waited = 0.0
        if not plan.done:
            start = time.perf_counter()
            with record_function("kvmem_map_wait"):
                while plan._run_next(self._cache):
                    pass
                plan._done.wait()
            waited = time.perf_counter() - start
            if record:
                self._cache.add_stall(waited)
        self._unobserved.discard(plan)
        if plan._errors:
            raise plan._errors[0]
        return waited

    def close(self) -> None:
        """Stop the thread after the plans and cleanups already queued; raise an error no ``wait`` or ``clean`` has
        seen."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        failed = [p for p in self._unobserved if p._errors]
        self._unobserved.clear()
        if failed:
            raise failed[0]._errors[0]
        if self._clean_error is not None:
            raise self._clean_error

    def __enter__(self) -> "AsyncMapper":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
