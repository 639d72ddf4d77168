"""SlotCache: the slot, page and reference-count bookkeeping both KV caches share.

A slot is one request's row of the cache. Its pages are a prefix list: page i backs tokens
``[i * page_tokens, (i + 1) * page_tokens)``. A page may sit in several slots (shared prefixes,
parallel samples); it is reference-counted and copied before a write lands in it (copy-on-write).
Subclasses say what a page is and how one is attached, detached and copied: ``VirtualKVCache`` maps
physical pages into virtual buffers, ``PagedKVCache`` writes block-table entries.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Hashable, Protocol, Self

import torch

from kvmem.errors import KVCacheError, KVCacheExhausted
from kvmem.spec import KVCacheSpec
from kvmem.stats import Counters, KVCacheStats, PageMap, SlotAccounting

Page = Hashable


def consecutive_runs(indices: list[int]) -> list[list[int]]:
    """Ascending ``indices`` cut where they stop being consecutive: the page runs one driver call each can take."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


class Fence(Protocol):
    """Work queued on a device (a recorded CUDA event): ``synchronize`` returns once it is done, ``query`` says
    whether it is."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


@dataclass
class SlotState:
    in_use: bool = False
    tokens: int = 0
    pages: list[Page] = field(default_factory=list)
    # Tokens the slot's request may grow to (its allocation's expectation, raised by every ``ensure``): pages
    # past it are surplus, left over from a longer request that used the slot before, and may be reclaimed.
    expected: int = 0
    # Set when the slot was freed while queued work may still read its pages: the first unmap waits for it.
    fence: Fence | None = None
    # Pages let go of while ``fence`` was pending, where the cache defers unmaps: still mapped at the slot's
    # addresses just past ``pages`` (the pool may hand them out again meanwhile), unmapped once ``fence`` is done
    # -- before anything else touches this slot's addresses.
    stale: list[Page] = field(default_factory=list)


class SlotCache(ABC):
    """Slots over ref-counted pages. All public methods are thread-safe (one re-entrant lock)."""

    #: Physical pages behind one page of a slot (one per buffer for the virtual cache).
    units_per_page: int = 1
    #: Deferred reclamation: a freed slot keeps its pages for the next request.
    keeps_pages_on_free: bool = False
    #: Pages taken from a slot that queued work may still read go back to the pool at once, their old mapping
    #: undone once that work is done (a page may be mapped at two addresses meanwhile: the new owner's writes are
    #: queued after the reads). Without it, taking them waits for that work first.
    defers_unmaps: bool = False
    #: With ``defers_unmaps``: every page a slot lets go of keeps its mapping until ``unmap_stale`` undoes it (an
    #: ``AsyncMapper``'s thread, between steps), unless its addresses are mapped again first. The call that let go of
    #: it -- a step's launch, reclaiming free slots' pages for a new request -- unmaps nothing itself.
    unmaps_in_background: bool = False
    #: ``fuse_prefix``: a run of pages made one allocation (the virtual cache, and a ledger that mirrors one).
    fuses_runs: bool = False

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        # Bytes of one token and of one page in one buffer: where a page's valid data ends.
        self._token_bytes = spec.token_bytes
        self._page_bytes = spec.page_bytes
        self._slots = [SlotState() for _ in range(spec.max_slots)]
        self._refs: dict[Page, int] = {}  # a plain dict: Counter's += costs a Python call per map
        # Pages held for later requests (prefix caching): key -> page, one reference each.
        self._kept: dict[int, Page] = {}
        self._num_shared = 0  # pages with refcount > 1: while 0, ensure() skips the copy-on-write scan
        self._lock = threading.RLock()
        self._counters = Counters()
        self._fence_wait_s = 0.0  # time unmaps waited for queued work that read a freed slot
        self._stale_slots: set[int] = set()  # slots with ``stale`` pages
        # When each slot was last freed or emptied (a count of such events): queued work may still read the latest.
        self._released = [0] * spec.max_slots
        self._releases = 0
        # Free slots holding a waiting request's cached prefix, mapped ahead of its admission (``map_prefixes_ahead``):
        # kept for it, not prepared for others or best fit for them.
        self._premapped: set[int] = set()
        # Runs of pages fused into one allocation (``fuse_prefix``): each member's run. A slot holds a run whole, at
        # consecutive pages in its order, or none of it (an allocation maps whole); the prefix cache holds all of a
        # run's keys or none (``_run_keys``: the keys it was fused under).
        self._runs: dict[Page, tuple[Page, ...]] = {}
        self._run_keys: dict[tuple[Page, ...], tuple[int, ...]] = {}
        self._runs_back: dict[tuple[Page, ...], int] = {}  # members of a run no one references, so far

    # -- what a subclass provides -------------------------------------------------------------
    @abstractmethod
    def _take(self, n: int) -> list[Page]:
        """``n`` fresh pages from the pool (the caller checked there are enough)."""

    @abstractmethod
    def _give(self, page: Page) -> None:
        """Return a page no slot references any more to the pool."""

    @abstractmethod
    def _free_units(self) -> int:
        """Physical pages free in the pool (may exceed whole slot pages' worth)."""

    @abstractmethod
    def _total_units(self) -> int:
        """Physical pages the pool holds in all (free or not)."""

    def _free_pages(self) -> int:
        """Slot pages the pool can hand out now."""
        return self._free_units() // self.units_per_page

    def _total_pages(self) -> int:
        return self._total_units() // self.units_per_page

    def close(self) -> None:
        """Give the KV memory back. Here nothing: memory torch allocated goes with the object."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fits(self, tokens: int) -> bool:
        """Whether one slot of ``tokens`` tokens could ever be backed by the whole pool."""
        with self._lock:
            return self.spec.pages_for(tokens) <= self._total_pages()

    @abstractmethod
    def _attach(self, slot: int, index: int, page: Page) -> None:
        """Make ``page`` back page ``index`` of ``slot``."""

    @abstractmethod
    def _detach(self, slot: int, index: int, page: Page) -> None:
        """Stop ``page`` backing page ``index`` of ``slot``."""

    @abstractmethod
    def _copy(self, slot: int, index: int, src: Page, dst: Page) -> None:
        """Copy the contents of ``src`` into ``dst`` (before ``dst`` replaces it in ``slot``)."""

    def _fuse(self, run: tuple[Page, ...]) -> None:
        """Make ``run`` (fresh pages, mapped nowhere) one allocation (``fuses_runs``)."""

    def _unfuse(self, run: tuple[Page, ...]) -> None:
        """Undo ``_fuse(run)``: no slot holds it any more."""

    def _copy_prefix(self, src: int, dst: int, pages: int) -> None:
        """Copy the bytes of ``src``'s first ``pages`` pages into ``dst``'s (both backed there)."""

    @abstractmethod
    def _pool_stats(self) -> tuple[int, int]:
        """(reserved bytes, pool bytes)."""

    @abstractmethod
    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` as ``[rows, H, D]``; ``token_rows`` says which row holds which token."""

    @abstractmethod
    def token_rows(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Row indices (see ``rows``) of tokens ``[start, stop)`` of ``slot``."""

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[n, H, D]``) at tokens ``[start, start + n)`` of ``slot``, which must be backed."""
        with self._lock:
            held = self._in_use(slot).tokens
            n = k.shape[0]
            if start < 0 or start + n > held or v.shape[0] != n:
                raise ValueError(
                    f"write of {n} tokens at {start} into slot {slot} outside the {held} tokens ensure() backed"
                )
            k_rows, v_rows = self.rows(layer)
            index = self.token_rows(slot, start, start + n).to(k_rows.device)
            k_rows[index] = k
            v_rows[index] = v

    # -- slots ---------------------------------------------------------------------------------
    def alloc_slot(self, expected_tokens: int = 0, slot: int | None = None) -> int:
        """Claim a free slot for a request expected to reach ``expected_tokens`` tokens.

        Best fit over the pages a slot still maps and holds alone (a request writes over those in place): the free
        slot with the fewest pages whose own cover the expectation, else the one with the most own pages, then the
        fewest pages shared with others or the prefix cache (each would be replaced by a fresh page, once the work
        queued before it was freed is done), then the one freed longest ago. ``slot`` claims that free slot instead
        (a worker replaying the choice its scheduler made). Pages the slot holds past the expectation are surplus:
        ``reclaim`` takes them when the pool runs short, after those of free slots.
        """
        self._check_tokens(expected_tokens, "expected_tokens")
        need = self.spec.pages_for(expected_tokens)
        with self._lock:
            if slot is not None:
                if not isinstance(slot, int) or not 0 <= slot < len(self._slots) or self._slots[slot].in_use:
                    raise ValueError(f"alloc_slot: slot {slot!r} is not a free slot of 0..{len(self._slots) - 1}")
            else:
                slot = self._best_fit(need)
            state = self._slots[slot]
            state.in_use, state.tokens, state.expected = True, 0, expected_tokens
            self._premapped.discard(slot)
            return slot

    def _best_fit(self, need: int) -> int:
        free = [i for i, s in enumerate(self._slots) if not s.in_use]
        if not free:
            raise KVCacheError(f"no free slot: all {self.spec.max_slots} slots are in use")
        free = [i for i in free if i not in self._premapped] or free  # a prefix mapped ahead waits for its request
        own = {i: self._own_pages(self._slots[i]) for i in free}
        fits = [i for i in free if own[i] >= need]
        if fits:
            return min(fits, key=lambda i: (len(self._slots[i].pages), self._released[i]))
        return max(free, key=lambda i: (own[i], own[i] - len(self._slots[i].pages), -self._released[i]))

    def _own_pages(self, state: SlotState, most: int | None = None) -> int:
        """How many of the slot's first pages (of its first ``most``) it alone holds, and may write over (a fused
        run's are never written over: ``_first_shared_past_tokens``)."""
        pages = state.pages if most is None else state.pages[:most]
        if not self._num_shared and not self._runs:
            return len(pages)
        refs, runs, n = self._refs, self._runs, 0
        for page in pages:
            if refs[page] != 1 or page in runs:
                break
            n += 1
        return n

    def _mark_released(self, slot: int) -> None:
        self._releases += 1
        self._released[slot] = self._releases

    def free_slot(self, slot: int, fence: Fence | None = None) -> None:
        """Finish with a slot. The virtual cache keeps its pages mapped for reuse (see ``reclaim``).

        Its pages may be unmapped or handed to another request from then on, so without a ``fence`` free a slot
        only once no queued kernel reads it any more. ``fence``: the last queued work that may read it; the
        slot's pages are unmapped only after it is done (the slot itself may be reused at once: work queued
        later on the same stream runs after it).
        """
        with self._lock:
            state = self._in_use(slot)
            state.in_use, state.tokens, state.expected = False, 0, 0
            self._mark_released(slot)
            if fence is not None:
                state.fence = fence
            if not self.keeps_pages_on_free:
                self._drop_tail(slot, 0)

    def eager_map(self, tokens: int, slots: int = 1, pages: int | None = None, drop: tuple[int, ...] = ()) -> int:
        """Give up to ``slots`` free slots pages of their own for ``tokens`` tokens ahead of their requests, from the
        pool's free pages only (never evicting or reclaiming), at most ``pages`` in this call (None: no limit);
        returns the pages mapped. ``drop``: held pages to let go of first (``drop_kept``), as a ledger chose them.

        A request given such a slot (``alloc_slot``'s best fit) writes its prompt where the pages are mapped: no map
        in its step's launch. The free slots go in a fixed order (those holding the most pages of their own first,
        then the one freed longest ago), so every worker replaying the call prepares the slots its ledger did. A
        slot whose pages are held by others too (a finished request's, in the prefix cache) lets go of them from the
        first such page (they stay cached)."""
        self._check_tokens(tokens, "tokens")
        need = self.spec.pages_for(tokens)
        with self._lock:
            if drop:
                self.drop_kept(drop)
            return self._eager_fill(self._eager_order(need)[:slots], need, pages)

    def _eager_fill(self, order: list[tuple[int, int]], need: int, pages: int | None) -> int:
        """``eager_map``'s filling of the free slots ``order`` gives (slot, pages it holds alone)."""
        left = self._free_pages() if pages is None else min(pages, self._free_pages())
        mapped = 0
        for slot, own in order:
            if left <= 0:
                break
            if own >= need:
                continue
            if own < len(self._slots[slot].pages):
                self._drop_tail(slot, own)
            n = min(need - own, left)
            self._link_run(slot, self._take(n))
            mapped, left = mapped + n, left - n
        return mapped

    def _eager_order(self, need: int) -> list[tuple[int, int]]:
        """Free slots and the pages each holds alone from its first (``need`` at most), in the order ``eager_map``
        prepares them (none holding a prefix mapped ahead)."""
        free = [(i, self._own_pages(s, need)) for i, s in enumerate(self._slots)
                if not s.in_use and i not in self._premapped]
        released = self._released
        free.sort(key=lambda e: (-e[1], released[e[0]], e[0]))
        return free

    def num_tokens(self, slot: int) -> int:
        """Tokens ``slot`` holds (what ``ensure`` last backed)."""
        with self._lock:
            return self._in_use(slot).tokens

    def ensure(self, slot: int, num_tokens: int) -> None:
        """Back the first ``num_tokens`` tokens of ``slot``, ready for writes from its current length.

        Maps missing pages and copies shared pages the write range touches (copy-on-write). Takes pages
        of free slots when the pool is short. Raises ``KVCacheExhausted`` with the state unchanged when
        even that is not enough.
        """
        self._ensure(slot, num_tokens, copy_shared=True)

    def _ensure(self, slot: int, num_tokens: int, copy_shared: bool) -> bool:
        """``ensure``; with ``copy_shared=False``, False and nothing done where a shared page would be copied."""
        self._check_tokens(num_tokens, "num_tokens")
        with self._lock:
            state = self._in_use(slot)
            need = self.spec.pages_for(num_tokens)
            shared = self._shared_in_write_range(state, need, num_tokens)
            if shared and not copy_shared:
                return False
            if self._stale_slots and not self.unmaps_in_background:
                # Stale mappings hold no references (``_drop_tail`` let go of them): this only keeps them few.
                self._unmap_stale(done_only=True)
            expected, state.expected = state.expected, max(state.expected, num_tokens)
            try:
                return self._back(slot, state, need, num_tokens, shared)
            except KVCacheExhausted:
                # Unchanged, as promised: a ledger's failed call is never replayed, and a raised expectation would
                # keep pages from its reclaims that the workers' do reclaim.
                state.expected = expected
                raise

    def _back(self, slot: int, state: SlotState, need: int, num_tokens: int, shared: list[int]) -> bool:
        """``_ensure``'s backing of ``slot`` to ``num_tokens`` (``need`` pages; ``shared``: pages in its write range
        that others hold too), its expectation raised already."""
        if need <= len(state.pages) and not shared and not (
                self._runs and any(p in self._runs for p in state.pages[state.tokens * self._token_bytes
                                                                        // self._page_bytes : need])):
            # Backed already, and no page the writes reach is shared (nor fused), so none past its tokens either:
            # nothing to map, copy or drop (a decode step's usual case, twice a sequence a step in the ledger).
            state.tokens = num_tokens
            return True
        # A reused slot's shared pages past the request's tokens hold none of its bytes: let go of them from the
        # first (one unmap) and map fresh pages as growth does -- ahead of the step, where copy-on-write would
        # replace them one by one inside it. Where the pool has no room for that, copy-on-write as before.
        keep = self._first_shared_past_tokens(state, need)
        cow = self._shared_in_write_range(state, min(need, keep), num_tokens)
        if (keep < len(state.pages) and not self._has_room(max(0, need - keep) + len(cow))
                and not any(page in self._runs for page in state.pages[keep:need])):  # a run goes whole, never copied
            keep = len(state.pages)
            cow = self._shared_in_write_range(state, need, num_tokens)
        demand = max(0, need - keep) + len(cow)
        if demand:
            self._make_room(demand, slot, num_tokens)
        if keep < len(state.pages):
            self._drop_tail(slot, keep)
        if cow:
            self._copy_on_write(slot, state, cow)
        if need > len(state.pages):
            self._link_run(slot, self._take(need - len(state.pages)))
        state.tokens = num_tokens
        return True

    def _first_shared_past_tokens(self, state: SlotState, need: int) -> int:
        """Index of the slot's first shared page, among those the writes up to ``need`` pages reach, that holds none
        of its tokens; the slot's page count where there is none. A fused run's page counts as shared even where the
        slot alone holds it: a run holds the prefix it was fused from, whole, and is let go of, never written over
        (the prefix cache may hold its keys again; a write would make it another prefix's, in part)."""
        if self._num_shared or self._runs:
            held = -(-state.tokens * self._token_bytes // self._page_bytes)  # pages holding some of its bytes
            for i in range(held, min(need, len(state.pages))):
                if self._refs[state.pages[i]] > 1 or state.pages[i] in self._runs:
                    return i
        return len(state.pages)

    def _shared_in_write_range(self, state: SlotState, need: int, num_tokens: int) -> list[int]:
        """Indices of shared pages that writes from ``state.tokens`` up to ``num_tokens`` would land in."""
        if not self._num_shared or num_tokens <= state.tokens or not state.pages:
            return []
        first = state.tokens * self._token_bytes // self._page_bytes  # where the next write starts
        return [i for i in range(first, min(need, len(state.pages))) if self._refs.get(state.pages[i], 0) > 1]

    def share_prefix(self, src: int, dst: int, tokens: int) -> None:
        """Make ``dst`` hold the first ``tokens`` tokens of ``src`` by sharing its pages.

        Whole pages are shared, the last one too when ``tokens`` ends inside it: the first write there,
        through either slot, copies it first. ``dst``'s own pages in that range are let go.
        """
        with self._lock:
            source, target = self._in_use(src), self._in_use(dst)
            if src == dst:
                raise ValueError(f"share_prefix: src and dst are the same slot {src}")
            if not 0 < tokens <= source.tokens:
                raise ValueError(f"share_prefix: tokens={tokens} outside (0, {source.tokens}] held by slot {src}")
            n = self.spec.pages_for(tokens)
            if self._run_start(source, n) != n:
                raise KVCacheError(f"share_prefix: {tokens} tokens of slot {src} end inside a fused run, which maps whole")
            self._replace_run(dst, source.pages[:n])
            self._link_run(dst, source.pages[len(target.pages) : n])
            target.tokens = tokens
            target.expected = max(target.expected, tokens)

    # -- kept prefix blocks -----------------------------------------------------------------------
    def keep(self, slot: int, page: int, key: int) -> None:
        """Hold page ``page`` of ``slot``, which the slot's tokens must fill (``spec.full_pages``), under ``key``,
        so that it outlives the slot: a later request maps it (``map_kept``) instead of computing it. The hold is a
        reference like a slot's: the page stays out of the pool, and ``reclaim`` never takes it, until ``drop_kept``."""
        with self._lock:
            state = self._in_use(slot)
            if key in self._kept:
                raise KVCacheError(f"keep: key {key} already holds a page")
            if not isinstance(page, int) or not 0 <= page < self.spec.full_pages(state.tokens):
                raise ValueError(f"keep: page {page!r} of slot {slot} is not full: the slot holds {state.tokens} tokens, "
                                 f"which fill {self.spec.full_pages(state.tokens)} pages")
            held = state.pages[page]
            self._incref(held)
            self._kept[key] = held

    def map_kept(self, slot: int, keys: tuple[int, ...] | list[int]) -> None:
        """Make the first ``len(keys)`` pages of ``slot``, which holds no tokens yet, the pages held under ``keys`` --
        the same pages mapped at this slot's offsets, no copy -- and its length the tokens that lie entirely in them
        (a token that runs on into the next page is computed again: its write copies the shared page first). The
        slot's own pages there are let go (none are mapped where the slot holds them already)."""
        with self._lock:
            state = self._in_use(slot)
            if state.tokens:
                raise ValueError(f"map_kept: slot {slot} holds {state.tokens} tokens already")
            missing = [k for k in keys if k not in self._kept]
            if missing:
                raise KVCacheError(f"map_kept: no page is kept under keys {missing}")
            if self._runs and len(self.whole_runs(list(keys))) != len(keys):
                raise KVCacheError(f"map_kept: keys {list(keys)[:4]}... end inside a fused run, which maps whole")
            pages = [self._kept[key] for key in keys]
            self._replace_run(slot, pages)
            self._link_run(slot, pages[len(state.pages) :])
            state.tokens = self.spec.tokens_within(len(keys))
            state.expected = max(state.expected, state.tokens)

    def fuse_prefix(self, src: int, dst: int, keys: tuple[int, ...] | list[int]) -> None:
        """``map_kept(dst, keys)``, the pages held under ``keys`` -- which ``src`` holds as its first pages -- made one
        allocation first: fresh pages, fused (``fuses_runs``), mapped whole into ``dst`` and given a copy of ``src``'s
        bytes there; the prefix cache then holds them under ``keys`` in place of the pages copied (which stay with the
        slots holding them). A later ``map_kept`` of these keys maps one allocation, not a page at a time: the
        driver's price of a mapping goes with the allocations, not the bytes (bench/vmm_run_costs.py). The copy is
        queued behind the work that wrote ``src``'s pages, and ``src``'s mappings stay until it is done."""
        with self._lock:
            if not self.fuses_runs:
                raise ValueError(f"fuse_prefix: {type(self).__name__} does not fuse pages")
            if not 0 <= src < len(self._slots):
                raise ValueError(f"fuse_prefix: slot {src!r} is not a slot of 0..{len(self._slots) - 1}")
            source, target = self._slots[src], self._in_use(dst)
            if target.tokens:
                raise ValueError(f"fuse_prefix: slot {dst} holds {target.tokens} tokens already")
            if src == dst:
                raise ValueError(f"fuse_prefix: src and dst are the same slot {src}")
            if missing := [k for k in keys if k not in self._kept]:
                raise KVCacheError(f"fuse_prefix: no page is kept under keys {missing}")
            held = [self._kept[key] for key in keys]
            if len(held) < 2 or source.pages[: len(held)] != held or any(p in self._runs for p in held):
                raise KVCacheError(f"fuse_prefix: slot {src} does not hold the {len(held)} unfused pages of keys "
                                   f"{list(keys)[:4]}... as its first pages")
            with self._sparing(src, len(held)):  # room from the pool or free slots' pages, never those the copy reads
                self._make_room(len(held), dst, self.spec.tokens_within(len(held)))
            run = tuple(self._take(len(held)))
            self._fuse(run)
            for page in run:
                self._runs[page] = run
            self._run_keys[run] = tuple(keys)
            self._drop_tail(dst, 0)
            self._link_run(dst, list(run))
            self._copy_prefix(src, dst, len(run))
            for key, page in zip(keys, run):
                self._incref(page)
                old, self._kept[key] = self._kept[key], page
                self._decref(old)
            target.tokens = self.spec.tokens_within(len(keys))
            target.expected = max(target.expected, target.tokens)

    def adopt_run(self, slot: int, keys: tuple[int, ...] | list[int]) -> bool:
        """Make ``slot``'s first pages, which hold the bytes of the fused run held under ``keys`` (the pages the run
        was copied from: ``fuse_prefix``'s source, or a slot that mapped them before), that run: once every such slot
        has, those pages go back to the pool, and the prefix is held once. Only once no queued work reads the slot
        (its pages are unmapped and the run mapped at their place). Returns whether the slot took the run."""
        with self._lock:
            state = self._slots[slot]
            if missing := [k for k in keys if k not in self._kept]:
                raise KVCacheError(f"adopt_run: no page is kept under keys {missing}")
            run = [self._kept[key] for key in keys]
            if len(run) < 2 or self._runs.get(run[0]) != tuple(run):
                raise KVCacheError(f"adopt_run: keys {list(keys)[:4]}... do not hold a fused run, whole")
            if len(state.pages) < len(run) or any(p in self._runs for p in state.pages[: len(run)]):
                return False
            self._swap_in(slot, [(i, state.pages[i], page) for i, page in enumerate(run)])
            return True

    @contextmanager
    def _sparing(self, slot: int, pages: int) -> Iterator[None]:
        """Meanwhile, a free ``slot`` counts as a slot in use expecting its first ``pages`` pages: no reclaim takes them
        (a fused run's copy reads them)."""
        state = self._slots[slot]
        if state.in_use:
            yield
            return
        expected = state.expected
        state.in_use, state.expected = True, self.spec.tokens_within(pages)
        try:
            yield
        finally:
            state.in_use, state.expected = False, expected

    def whole_runs(self, keys: list[int]) -> list[int]:
        """``keys`` (a run of held pages from a sequence's first) up to the first fused run it holds only part of: such a
        run maps whole, or not at all."""
        with self._lock:
            if not self._runs:
                return keys
            i = 0
            while i < len(keys):
                run = self._runs.get(self._kept.get(keys[i]))
                if run is None:
                    i += 1
                    continue
                if run.index(self._kept[keys[i]]) or [self._kept.get(k) for k in keys[i : i + len(run)]] != list(run):
                    return keys[:i]
                i += len(run)
            return keys

    def map_prefixes_ahead(self, prefixes: tuple[tuple[int, tuple[int, ...]], ...]) -> int:
        """For each ``(slot, keys)``: make the first pages of free slot ``slot`` the pages held under ``keys`` (a
        waiting request's cached prefix, or its first part), mapped now -- on a worker's mapper thread, beside a step
        -- so that the request, given that slot (``slot_holding``), maps nothing in its own step's launch. The slot's
        own pages there are let go; those past them stay, for its request to write over or let go of. These slots, and
        no others, are then kept for their requests: no ``eager_map`` preparation or best fit takes them. Returns the
        pages mapped."""
        with self._lock:
            for slot, keys in prefixes:
                if not 0 <= slot < len(self._slots) or self._slots[slot].in_use:
                    raise ValueError(f"map_prefixes_ahead: slot {slot!r} is not a free slot of 0..{len(self._slots) - 1}")
                if missing := [k for k in keys if k not in self._kept]:
                    raise KVCacheError(f"map_prefixes_ahead: no page is kept under keys {missing}")
                if self._runs and len(self.whole_runs(list(keys))) != len(keys):
                    raise KVCacheError(f"map_prefixes_ahead: keys {list(keys)[:4]}... end inside a fused run")
            mapped = 0
            for slot, keys in prefixes:
                state, pages = self._slots[slot], [self._kept[key] for key in keys]
                mapped += sum(a != b for a, b in zip(state.pages, pages)) + max(0, len(pages) - len(state.pages))
                self._replace_run(slot, pages)
                self._link_run(slot, pages[len(state.pages):])
            self._premapped = {slot for slot, _ in prefixes}
            return mapped

    def drop_kept(self, keys: tuple[int, ...] | list[int]) -> None:
        """Let go of the pages held under ``keys``; those nothing else references go back to the pool."""
        with self._lock:
            missing = [k for k in keys if k not in self._kept]
            if missing:
                raise KVCacheError(f"drop_kept: no page is kept under keys {missing}")
            for key in keys:
                self._decref(self._kept.pop(key))

    def kept_pages(self) -> int:
        with self._lock:
            return len(self._kept)

    def reclaim(self, pages: int) -> int:
        """Let go of pages that free slots still hold, then of slots' pages past their expectation, until
        ``pages`` physical pages went back to the pool (or none are left); returns the physical pages freed."""
        if pages < 0:
            raise ValueError(f"reclaim: pages must be >= 0, got {pages}")
        with self._lock:
            return self._reclaim(pages)

    # -- internals -----------------------------------------------------------------------------
    def _check_tokens(self, tokens: int, name: str) -> None:
        if not isinstance(tokens, int) or not 0 <= tokens <= self.spec.max_tokens:
            raise ValueError(f"{name}={tokens!r} outside [0, max_tokens={self.spec.max_tokens}]")

    def _in_use(self, slot: int) -> SlotState:
        if not isinstance(slot, int) or not 0 <= slot < len(self._slots):
            raise ValueError(f"unknown slot {slot!r}: slots are 0..{len(self._slots) - 1}")
        state = self._slots[slot]
        if not state.in_use:
            raise ValueError(f"slot {slot} is not in use (never allocated, or freed twice)")
        return state

    def _link_run(self, slot: int, pages: list[Page]) -> None:
        """Append ``pages`` to ``slot``'s, attached as one run (``_attach_run``)."""
        if not pages:
            return
        state = self._slots[slot]
        if state.stale:  # they lie where these go
            self._await_fence(slot)
        first = len(state.pages)
        state.pages.extend(pages)
        for page in pages:
            self._incref(page)
        self._attach_run(slot, first, pages)
        self._counters.mappings += self._allocations(pages)

    def _allocations(self, pages: list[Page]) -> int:
        """What the driver pays for mapping ``pages`` (``mapping_calls``): an allocation a page, a fused run's one."""
        if not self._runs:
            return len(pages)
        return len(pages) - sum(len(run) - 1 for run in {self._runs[p] for p in pages if p in self._runs})

    def _attach_run(self, slot: int, first: int, pages: list[Page]) -> None:
        """Make ``pages`` back pages ``first, first + 1, ...`` of ``slot`` (one at a time, unless a subclass can
        do better)."""
        for index, page in enumerate(pages, start=first):
            self._attach(slot, index, page)

    def _incref(self, page: Page) -> None:
        count = self._refs.get(page, 0) + 1
        self._refs[page] = count
        if count == 2:
            self._num_shared += 1

    def _await_fence(self, slot: int) -> None:
        """Wait for the work queued before ``slot`` was freed (which may still read it), then undo the mappings of
        its stale pages."""
        state = self._slots[slot]
        if state.fence is not None:  # queued work may still read this slot: unmap nothing before it is done
            start = time.perf_counter()
            state.fence.synchronize()
            self._fence_wait_s += time.perf_counter() - start
            state.fence = None
        if state.stale:
            stale, state.stale = state.stale, []
            self._stale_slots.discard(slot)
            self._detach_run(slot, len(state.pages), stale)

    def unmap_stale(self) -> int:
        """Undo the stale mappings of the slots whose queued readers are done, a slot at a time under the lock (a step's
        launch waits for one slot's at most); returns the pages unmapped. What ``AsyncMapper.clean`` runs."""
        with self._lock:
            slots = list(self._stale_slots)
        unmapped = 0
        for slot in slots:
            with self._lock:
                state = self._slots[slot]
                if state.stale and (state.fence is None or state.fence.query()):
                    unmapped += len(state.stale)
                    self._await_fence(slot)
        return unmapped

    @property
    def has_stale(self) -> bool:
        """Whether some slot keeps mappings of pages it let go of (``unmap_stale`` has work)."""
        return bool(self._stale_slots)

    def _unmap_stale(self, done_only: bool) -> None:
        """Undo the stale mappings of every slot whose fence is done (``done_only``), or of all, waiting."""
        for slot in list(self._stale_slots):
            fence = self._slots[slot].fence
            if not done_only or fence is None or fence.query():
                self._await_fence(slot)

    def _replace_run(self, slot: int, pages: list[Page], first: int = 0) -> None:
        """Make pages ``first, first + 1, ...`` of ``slot`` (those it holds already) be ``pages``: where one differs,
        the slot's own goes (``_swap``, all at once) and the page given takes its place."""
        state = self._slots[slot]
        changes = [(i, state.pages[i], page) for i, page in enumerate(pages[: len(state.pages) - first], start=first)
                   if state.pages[i] != page]
        if not changes:
            return
        if self._runs and any(old in self._runs or new in self._runs for _, old, new in changes):
            # A fused run maps whole: the slot lets go of its pages from the first change (from the start of the run
            # it falls in), and the caller links the rest of ``pages`` there.
            self._drop_tail(slot, changes[0][0])
            return
        self._swap_in(slot, changes)

    def _swap_in(self, slot: int, changes: list[tuple[int, Page, Page]]) -> None:
        """For each ``(index, old, new)``, ``new`` takes page ``index`` of ``slot`` (``_swap``), once no queued work
        reads the slot."""
        state = self._slots[slot]
        self._await_fence(slot)
        for index, _, page in changes:
            state.pages[index] = page
            self._incref(page)
        self._swap(slot, changes)
        self._counters.mappings += self._allocations([page for _, _, page in changes])
        for _, old, _ in changes:
            self._decref(old)

    def _swap(self, slot: int, changes: list[tuple[int, Page, Page]]) -> None:
        """For each ``(index, old, new)``: ``new`` backs page ``index`` of ``slot`` instead of ``old`` (one at a time,
        unless a subclass can do better)."""
        for index, old, new in changes:
            self._detach(slot, index, old)
            self._attach(slot, index, new)

    def _decref(self, page: Page) -> None:
        count = self._refs[page] - 1
        if count == 1:
            self._num_shared -= 1
        if count:
            self._refs[page] = count
        else:
            del self._refs[page]
            self._release(page)

    def _release(self, page: Page) -> None:
        """Give a page no one references back to the pool; a fused run's once all of its pages are (none of them
        maps alone), as pages of their own again."""
        run = self._runs.get(page)
        if run is None:
            self._give(page)
            return
        back = self._runs_back.get(run, 0) + 1
        if back < len(run):
            self._runs_back[run] = back
            return
        self._runs_back.pop(run, None)
        self._run_keys.pop(run, None)
        for member in run:
            del self._runs[member]
        self._unfuse(run)
        for member in run:
            self._give(member)

    def _run_start(self, state: SlotState, index: int) -> int:
        """``index``, or where the fused run holding the slot's page there starts when it starts before it."""
        if index >= len(state.pages) or (run := self._runs.get(state.pages[index])) is None:
            return index
        return index - run.index(state.pages[index])

    def _drop_tail(self, slot: int, keep: int) -> None:
        """Let go of ``slot``'s pages from ``keep`` on, all at once (``_detach_run``); from the start of a fused run
        that ``keep`` falls inside."""
        state = self._slots[slot]
        if self._runs and (start := self._run_start(state, keep)) != keep:
            if state.in_use and state.tokens * self._token_bytes > start * self._page_bytes:
                raise KVCacheError(f"slot {slot}: letting go of its pages from {keep} on would take a fused run that "
                                   "holds its tokens")
            keep = start
        dropped = state.pages[keep:]
        if not dropped:
            return
        if self.defers_unmaps and (self.unmaps_in_background or (state.fence is not None and not state.fence.query())):
            state.stale[:0] = dropped  # just below the stale pages already there: one run
            self._stale_slots.add(slot)
        else:
            self._await_fence(slot)
            self._detach_run(slot, keep, dropped)
        del state.pages[keep:]
        if not state.in_use:
            self._mark_released(slot)
        for page in dropped:
            self._decref(page)

    def _detach_run(self, slot: int, first: int, pages: list[Page]) -> None:
        """Stop ``pages``, the last of ``slot``'s from page ``first`` on, backing it (from the end, one at a time,
        unless a subclass can do better)."""
        for index in range(first + len(pages) - 1, first - 1, -1):
            self._detach(slot, index, pages[index - first])

    def _copy_on_write(self, slot: int, state: SlotState, indices: list[int]) -> None:
        """Give ``slot`` fresh pages of its own at ``indices`` (ascending), copying the valid bytes of each; a run
        of consecutive ones replaced at once (a request over a freed slot whose pages the prefix cache holds
        replaces them all, and holds no bytes to copy)."""
        if self._runs and (fused := [i for i in indices if state.pages[i] in self._runs]):
            raise KVCacheError(f"slot {slot}: a write would copy pages {fused} of a fused run, which holds whole "
                               "pages of a cached prefix only")
        for run in consecutive_runs(indices):
            new = self._take(len(run))
            for index, page in zip(run, new):
                if state.tokens * self._token_bytes > index * self._page_bytes:  # stale bytes past them need none
                    self._copy(slot, index, state.pages[index], page)
            self._replace_run(slot, new, run[0])

    def _surplus(self, state: SlotState) -> list[Page]:
        """The pages a slot may let go of: all of a free slot's, those past its expectation for one in use."""
        return state.pages[len(state.pages) - self._num_surplus(state):]

    def _num_surplus(self, state: SlotState) -> int:
        keep = self.spec.pages_for(max(state.expected, state.tokens)) if state.in_use else 0
        return max(0, len(state.pages) - keep)

    def _reclaimable(self) -> int:
        """Slot pages freed if every slot let go of its surplus (a walk over every slot's pages)."""
        held = Counter(p for s in self._slots for p in self._surplus(s))
        return sum(1 for page, n in held.items() if self._refs.get(page, 0) == n)

    def _reclaim_order(self) -> list[int]:
        """Slots with surplus pages, in the order ``reclaim`` takes them: free slots, the one freed longest ago first,
        then slots in use, the most surplus first. A slot freed last may still be read by the steps in flight: its
        unmaps would wait for them (deferred, and then the next request given the slot waits for them, in the step's
        launch) where an older slot's are done at once."""
        free, used = [], []
        for i, s in enumerate(self._slots):
            if n := self._num_surplus(s):
                (used if s.in_use else free).append((-n if s.in_use else self._released[i], i))
        return [i for _, i in sorted(free)] + [i for _, i in sorted(used)]

    def _owned_tail(self, state: SlotState, limit: int) -> int:
        """How many surplus pages, counted from the slot's end and up to ``limit``, the slot alone holds."""
        pages, n = state.pages, 0
        for _ in range(min(limit, self._num_surplus(state))):
            if self._refs[pages[-1 - n]] != 1:
                break
            n += 1
        return n

    def _reclaims_at_least(self, pages: int) -> bool:
        """Whether ``reclaim``'s first pass (pages their slot alone holds) frees ``pages``; stops once it does,
        so the common case costs no walk over every page."""
        found = 0
        for state in self._slots:  # the total does not depend on the order: no sort
            if state.pages:
                found += self._owned_tail(state, pages - found)
                if found >= pages:
                    return True
        return False

    def reclaim_batch(self) -> int:
        """Pages a reclaim that has to walk the slots frees at least, where slots alone hold that many: the walk
        costs a pass over every slot, so once the pool runs dry it is paid once per batch of pages, not once per
        page each growing sequence asks for (which made decoding behind a full prefix cache walk every slot at
        almost every page)."""
        return max(1, self._total_pages() // 256)

    def _has_room(self, pages: int) -> bool:
        """Whether ``_make_room(pages)`` would succeed (it walks the slots where the pool alone is short)."""
        free = self._free_pages()
        return pages <= free or self._reclaims_at_least(pages - free) or pages <= free + self._reclaimable()

    def _make_room(self, pages: int, slot: int, tokens: int) -> None:
        free = self._free_pages()
        if pages <= free:
            return
        if not self._has_room(pages):
            unit, available = self.units_per_page, free + self._reclaimable()
            raise KVCacheExhausted(pages * unit, available * unit, f"slot {slot} to hold {tokens} tokens")
        self._reclaim((pages - free) * self.units_per_page, self.reclaim_batch())
        assert self._free_pages() >= pages, "reclaim freed less than it counted"

    def _reclaim(self, units: int, batch: int = 0) -> int:
        """Free ``units`` physical pages, and up to ``batch`` slot pages more of those their slot alone holds."""
        start = self._free_pages()
        need = start - (-units // self.units_per_page)
        order = self._reclaim_order()
        # First only pages their slot alone holds, from each slot's end, each slot's at once: letting go of a page
        # that a kept prefix or another slot holds too unmaps it and frees nothing. Then any surplus, a page at a time
        # and no further than the need (a page only free slots share is freed once the last lets go; an owned page
        # may lie under a shared one).
        for owned_only, target in ((True, max(need, start + batch)), (False, need)):
            for slot in order:
                if self._free_pages() >= target:
                    break
                state = self._slots[slot]
                if owned_only:
                    self._drop_tail(slot, len(state.pages) - self._owned_tail(state, target - self._free_pages()))
                else:
                    keep = len(state.pages) - self._num_surplus(state)
                    while len(state.pages) > keep and self._free_pages() < target:
                        self._drop_tail(slot, len(state.pages) - 1)
        return (self._free_pages() - start) * self.units_per_page

    # -- stats ---------------------------------------------------------------------------------
    def add_stall(self, seconds: float) -> None:
        """Record time a caller waited for mapping it needed (the ``AsyncMapper`` reports here)."""
        with self._lock:
            self._counters.stall_seconds += seconds

    def free_pages(self) -> int:
        """Slot pages the pool can hand out now (without reclaiming)."""
        with self._lock:
            return self._free_pages()

    def pages_in_use(self) -> int:
        """Distinct pages that slots in use hold (not those free slots keep for reuse). Walks the slots."""
        with self._lock:
            return len({p for s in self._slots if s.in_use for p in s.pages})

    def slots_in_use(self) -> int:
        with self._lock:
            return sum(s.in_use for s in self._slots)

    def mapped_bytes(self) -> int:
        """Physical bytes slots hold now (cheap: what ``stats().mapped_bytes`` reports)."""
        with self._lock:
            return len(self._refs) * self._page_bytes * self.spec.num_buffers

    def accounting(self) -> SlotAccounting:
        """Tokens and page count of every slot, free pages and shared pages: what a scheduler's
        ``PageLedger`` and every worker's cache must agree on exactly."""
        with self._lock:
            return SlotAccounting(
                tuple((s.in_use, s.tokens, len(s.pages)) for s in self._slots), self._free_pages(), self._num_shared,
                len(self._kept),
            )

    def page_map(self) -> PageMap:
        """Each slot's pages as ``PageMap`` draws them (a slot's pages map the start of its range, in order)."""
        width = self.spec.pages_for(self.spec.slot_tokens)
        with self._lock:
            cached = set(self._kept.values())
            rows = []
            for s in self._slots:
                used = self.spec.pages_for(s.tokens) if s.in_use else 0
                cells = [self._cell(p, i < used, p in cached) for i, p in enumerate(s.pages)]
                rows.append("".join(cells).ljust(width, "."))
            return PageMap(self._page_bytes, tuple(rows), tuple(s.in_use for s in self._slots))

    def _cell(self, page: Page, used: bool, cached: bool) -> str:
        if not used:
            return "C" if cached else "M"
        held_by_slots = self._refs.get(page, 0) - cached
        return "S" if held_by_slots > 1 else "C" if cached else "U"

    def counters(self) -> tuple[int, int, float]:
        """(maps, unmaps, stall seconds) so far: cheap enough to read every step."""
        with self._lock:
            c = self._counters
            return c.maps, c.unmaps, c.stall_seconds

    def mapping_calls(self) -> int:
        """Allocations mapped so far -- a page, or a fused run's pages together: what the driver's calls go with
        (``counters``' maps count pages)."""
        with self._lock:
            return self._counters.mappings

    def fence_wait_seconds(self) -> float:
        """Seconds unmaps waited so far for queued work that still read a freed slot (``free_slot``'s fence)."""
        with self._lock:
            return self._fence_wait_s

    def recent_map_latency_us(self, n: int) -> tuple[float, ...]:
        """The latest ``n`` map latency samples (at most what the counters keep)."""
        with self._lock:
            samples = self._counters.map_latency_us
            return tuple(samples)[len(samples) - min(n, len(samples)):]

    def stats(self) -> KVCacheStats:
        """A consistent snapshot of memory and activity."""
        with self._lock:
            token_bytes, page_bytes = self._token_bytes, self._page_bytes
            valid: dict[Page, int] = {}
            for state in self._slots:
                if not state.in_use:
                    continue
                for index, page in enumerate(state.pages):
                    on_page = min(page_bytes, max(0, state.tokens * token_bytes - index * page_bytes))
                    valid[page] = max(valid.get(page, 0), on_page)
            buffers = self.spec.num_buffers
            reserved, pool = self._pool_stats()
            c = self._counters
            return KVCacheStats(
                reserved_bytes=reserved,
                pool_bytes=pool,
                mapped_bytes=self.mapped_bytes(),
                used_bytes=sum(valid.values()) * buffers,
                free_pages=self._free_units(),
                slots_in_use=sum(s.in_use for s in self._slots),
                maps=c.maps,
                unmaps=c.unmaps,
                map_latency_us=tuple(c.map_latency_us),
                stall_seconds=c.stall_seconds,
            )


class NumberedSlotCache(SlotCache):
    """Slots over pages that are plain numbers ``0..num_pages-1`` on a free list: the paged cache's blocks,
    or a ledger's pages that back nothing."""

    def __init__(self, spec: KVCacheSpec, num_pages: int):
        super().__init__(spec)
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    def _take(self, n: int) -> list[int]:
        taken = self._free[len(self._free) - n:] if n else []
        del self._free[len(self._free) - n:]
        return taken

    def _give(self, page: int) -> None:
        self._free.append(page)

    def _free_units(self) -> int:
        return len(self._free)

    def _total_units(self) -> int:
        return self.num_pages

    def _attach(self, slot: int, index: int, page: int) -> None:
        self._counters.maps += 1

    def _detach(self, slot: int, index: int, page: int) -> None:
        self._counters.unmaps += 1
