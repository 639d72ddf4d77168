"""PageLedger: a scheduler's page accounting -- ``SlotCache`` bookkeeping with no memory behind it."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from kvmem.errors import KVCacheExhausted
from kvmem.mapper import MappingPlan
from kvmem.ops import AdoptRun, AllocSlot, DropKept, Ensure, FreeSlot, FusePrefix, KeepPage, KVOp, MapKept, SharePrefix
from kvmem.prefix import BlockHash, PrefixIndex
from kvmem.slots import Fence, NumberedSlotCache, SlotState
from kvmem.spec import KVCacheSpec


# Pages ``eager_ahead`` has the workers' mappers map a step at most. The next step's launch waits for them (its
# operations come after them in the ledger's order), so they must take well under a step: ~1.1 ms at the 68 us a page
# of an idle H200 (vmm_latency_h200.json), up to 6 ms at the 373 us p50 of a loaded run, against ~7 ms a decode step
# at 64 clients.
EAGER_PAGES = 16
# The share of the pool (one part in this many) that prepared free slots may hold.
EAGER_SHARE = 8


def _run_length(pages: list[int], want: list[int]) -> int:
    """How many of ``want``, from its first on, ``pages`` holds at the same places."""
    n = 0
    for a, b in zip(pages, want):
        if a != b:
            break
        n += 1
    return n


class PageLedger(NumberedSlotCache):
    """Slots, page counts, refcounts and deferred reclamation exactly as a worker's cache keeps them,
    over ``num_pages`` numbered pages that back nothing.

    Every change (alloc, free, ensure, share) is recorded as a ``KVOp``; ``take_ops`` hands the list to
    the workers, which replay it on their real caches (``kvmem.ops.apply_ops``) and so stay in step.
    ``keeps_pages_on_free`` follows the workers' caches: True for the virtual layouts, False for paged.

    ``caches_prefixes``: prefix caching. The full pages of the sequences' tokens are indexed by hash
    (``cache_pages``) and held (``SlotCache.keep``) until memory runs short, when the ledger evicts the least
    recently used that no slot in use holds (``DropKept``) before it raises ``KVCacheExhausted``. A new request
    maps the longest held run of its pages (``map_prefix``). The workers replay all of it and decide nothing.
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int, keeps_pages_on_free: bool, caches_prefixes: bool = False):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        super().__init__(spec, num_pages)
        self.keeps_pages_on_free = keeps_pages_on_free
        self.fuses_runs = keeps_pages_on_free  # the virtual layouts' caches fuse runs (``fuse_prefix``); paged's do not
        self.prefixes = PrefixIndex() if caches_prefixes else None
        self._ops: list[KVOp] = []
        self._eager = False  # free slots are prepared for new requests (``eager_ahead``)
        self._allocs = 0
        # The state in which ``eager_ahead`` last found nothing to do: while it holds, neither will the next call (a
        # walk of every free slot's pages, most steps of a serving loop).
        self._eager_idle: tuple[int, ...] | None = None
        self.prefix_pages_ahead = 0  # cached prefixes' pages mapped into free slots ahead of their requests
        self.prefix_runs_fused = 0  # cached prefixes made one allocation on their first reuse (``fuse_prefix``)
        self._fused_from: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (pages copied, keys) since adopt_fused

    # -- recorded changes ----------------------------------------------------------------------
    def alloc_slot(self, expected_tokens: int = 0, slot: int | None = None) -> int:
        slot = super().alloc_slot(expected_tokens, slot)
        self._allocs += 1
        self._ops.append(AllocSlot(slot, expected_tokens))
        return slot

    def free_slot(self, slot: int, fence: Fence | None = None) -> None:
        super().free_slot(slot, fence)
        self._ops.append(FreeSlot(slot))

    def ensure(self, slot: int, num_tokens: int) -> None:
        """``SlotCache.ensure``, evicting cached prefix pages first where memory is short (recorded before it).
        A call that changes nothing (mapped ahead already) is not recorded."""
        with self._lock:
            state = self._in_use(slot)
            unchanged = state.tokens == num_tokens
            if unchanged and not self._stale_slots:
                # Backed to exactly these tokens by the last call (a decode step's, mapped ahead): ``SlotCache.ensure``
                # would find nothing to map, copy or drop, and there is nothing to evict for. Skipping it takes a
                # quarter off a decode-heavy step's scheduling (bench/scheduler_overhead.py).
                return
            if self.prefixes is not None:
                self._check_tokens(num_tokens, "num_tokens")
                self._evict_for(lambda: self._demand(state, num_tokens))
        super().ensure(slot, num_tokens)
        if not unchanged:
            self._ops.append(Ensure(slot, num_tokens))

    def ensure_ahead(self, targets: dict[int, int]) -> dict[int, int]:
        """Back each slot of ``targets`` up to its tokens for mapping ahead, unrecorded (the plan travels apart, as a
        ``MappingPlan``); returns those backed. A slot is left out, with nothing done, where the pool is short or a
        shared page would have to be copied -- that copy would run on the workers' mapper threads beside the step
        still writing the page.

        Cached prefix pages are evicted for all of them first, recorded: the workers apply the step's operations
        before their mappers run the plan's ensures, so the ledger does too, or a worker's ensure would meet a pool
        its ledger's did not and reclaim other pages. (Where nothing was evicted ahead, a decode behind a full prefix
        cache could never be mapped ahead: every step would map its new pages in its own launch.)"""
        for tokens in targets.values():
            self._check_tokens(tokens, "num_tokens")
        with self._lock:
            states = [(self._in_use(slot), tokens) for slot, tokens in targets.items()]
            # (A decode step's usual case needs no page, or one the pool has: no eviction is looked for.)
            if self.prefixes is not None and sum(max(0, self.spec.pages_for(t) - len(st.pages)) for st, t in states) \
                    > self._free_pages():
                self._evict_for(lambda: sum(self._demand(st, t) for st, t in states))
            backed = {}
            for slot, tokens in targets.items():
                try:
                    # ``SlotCache``'s, not this class's ``ensure``: it records nothing
                    if self._ensure(slot, tokens, copy_shared=False):
                        backed[slot] = tokens
                except KVCacheExhausted:
                    pass
            return backed

    def eager_ahead(self, tokens: int, slots: int) -> MappingPlan | None:
        """Prepare free slots for ``tokens``-token requests to come (``SlotCache.eager_map``: up to ``slots`` free slots
        holding pages of their own), unrecorded, a slot's worth of pages a call (``EAGER_PAGES`` at most); returns the
        plan that has every worker's mapper do the same after the step's ensures (None: nothing to do).

        The pages come from the pool, and where it is short from the least recently used cached pages that no slot
        holds, dropped in the same call on the workers (in no slot: dropping one unmaps nothing). A page for each slot in
        use stays in the pool (the next page it grows into), and the prepared slots hold an ``EAGER_SHARE``-th of the
        pool at most."""
        need = self.spec.pages_for(tokens)
        with self._lock:
            self._eager = True
            idle = (tokens, slots, self._releases, self._allocs)
            if self._eager_idle in (idle, (*idle, self._free_pages(), len(self._kept))):
                return None
            order = self._eager_order(need)[:slots]
            missing = next((need - own for _, own in order if own < need), 0)
            if not missing:
                self._eager_idle = idle  # all prepared: until a slot is taken or freed
                return None
            prepared = sum(own for _, own in order)
            budget = min(missing, EAGER_PAGES, self._total_pages() // EAGER_SHARE - prepared)
            reserve = sum(1 for s in self._slots if s.in_use)  # a page for each slot in use to grow into
            drop = self._unheld(budget + reserve - self._free_pages())
            budget = min(budget, self._free_pages() + len(drop) - reserve)
            if budget <= 0:
                self._eager_idle = (*idle, self._free_pages(), len(self._kept))  # until pages come free
                return None
            self._eager_idle = None
            if drop:  # pages in no slot: the order stays
                drop = self._with_whole_runs(drop)
                self.drop_kept(drop)
                self.prefixes.remove(drop)
            self._eager_fill(order, need, budget)  # maps ``budget`` pages: the pool has them
            return MappingPlan({}, tokens, slots, budget, drop)

    def _unheld(self, most: int) -> tuple[int, ...]:
        """Keys of up to ``most`` cached pages that no slot holds, least recently used first (a bounded look)."""
        drop = []
        if most > 0 and self.prefixes is not None:
            for key in itertools.islice(self.prefixes.eviction_order(), 4 * most + 64):
                if self._refs[self._kept[key]] == 1:
                    drop.append(key)
                    if len(drop) == most:
                        break
        return tuple(drop)

    def share_prefix(self, src: int, dst: int, tokens: int) -> None:
        super().share_prefix(src, dst, tokens)
        self._ops.append(SharePrefix(src, dst, tokens))

    # -- prefix caching ------------------------------------------------------------------------
    def cached_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """Keys of the longest run of ``hashes`` (a sequence's first pages) whose pages are held."""
        return self.prefixes.match(hashes) if self.prefixes is not None else []

    def slot_holding(self, keys: list[int]) -> int | None:
        """The free slot holding the longest run of the pages held under ``keys`` from its first (the request that
        computed them used that slot, or they were mapped there ahead: ``prefix_ahead``), the one freed longest ago
        among equals; None where none holds the first. Mapping the prefix there maps only the rest."""
        with self._lock:
            free = (i for i, s in enumerate(self._slots) if not s.in_use and s.pages)
            return self._longest_holder([self._kept[key] for key in keys], free)[1]

    def _longest_holder(self, pages: list, slots) -> tuple[int, int | None]:
        """(run, slot): of ``slots``, the one holding the longest run of ``pages`` from its first, the one freed longest
        ago among equals; (0, None) where none holds the first."""
        held = [(run, i) for i in slots if (run := _run_length(self._slots[i].pages, pages))]
        return max(held, key=lambda e: (e[0], -self._released[e[1]]), default=(0, None))

    def prefix_ahead(self, hits: list[list[int]], pages: int) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
        """Free slots for waiting requests' cached prefixes (``hits``: each one's keys, in the order they will be
        admitted), their pages mapped there ahead (``SlotCache.map_prefixes_ahead``), unrecorded, ``pages`` new
        mappings at most (a prefix past them is mapped in part: its request maps the rest); returns the
        ``(slot, keys)`` the workers' mappers do the same with, after the step's ensures and ``eager_ahead``'s plan
        (None: nothing to do; an empty tuple lets the slots kept by the last call go).

        A request's slot is the free one that holds the longest run of its pages already, else the one mapping the
        fewest pages (the least to let go of; a slot prepared for a new prompt keeps its own), then the one freed
        longest ago (its last readers long done)."""
        with self._lock:
            if not hits:  # a decode step's usual case: nothing waits, or nothing waiting hits
                if not self._premapped:
                    return None
                self.map_prefixes_ahead(())
                return ()
            by_first: dict[int, list[int]] = {}  # free slots by their first page
            for i, s in enumerate(self._slots):
                if not s.in_use and s.pages:
                    by_first.setdefault(s.pages[0], []).append(i)
            blank = iter(sorted((i for i, s in enumerate(self._slots) if not s.in_use),
                                key=lambda i: (len(self._slots[i].pages), self._released[i], i)))
            chosen: dict[int, tuple[int, ...]] = {}
            for keys in hits:
                want = [self._kept[key] for key in keys]
                run, slot = self._longest_holder(want, (i for i in by_first.get(want[0], ()) if i not in chosen))
                if slot is None:
                    if pages <= 0 or (slot := next((i for i in blank if i not in chosen), None)) is None:
                        continue
                n = len(self.whole_runs(list(keys[: min(len(keys), run + max(pages, 0))])))
                if n:
                    chosen[slot] = tuple(keys[:n])
                    pages -= n - run
            if not chosen and not self._premapped:
                return None
            prefixes = tuple(chosen.items())
            self._eager_idle = None  # slots changed hands: what eager preparation found may hold no longer
            self.prefix_pages_ahead += self.map_prefixes_ahead(prefixes)
            return prefixes

    def fusable(self, keys: list[int], dst: int, least: int) -> int | None:
        """A slot (not ``dst``) holding the pages held under ``keys`` as its first, unfused, where fusing them
        (``fuse_prefix``) is worth a copy: ``least`` pages at least, ``dst`` not holding them already (its request
        maps nothing then), and as many pages free in the pool or in free slots alone (fusing evicts no cached page).
        None: map them as they are (``map_prefix``)."""
        if not self.fuses_runs or len(keys) < max(2, least):
            return None
        with self._lock:
            pages = [self._kept[key] for key in keys]
            if pages[0] in self._runs or _run_length(self._slots[dst].pages, pages) == len(pages):
                return None
            first = pages[0]  # (a look at each slot's first page, and a walk only of those that hold it)
            run, src = self._longest_holder(pages, (i for i, st in enumerate(self._slots)
                                                    if i != dst and st.pages and st.pages[0] == first))
            if run < len(pages):
                return None
            with self._sparing(src, len(pages)):  # as ``fuse_prefix`` makes room
                return src if self._has_room(len(pages)) else None

    def fused(self, key: int) -> bool:
        """Whether the page held under ``key`` is part of a fused run."""
        with self._lock:
            return self._kept[key] in self._runs

    def fuse_prefix(self, src: int, dst: int, keys: tuple[int, ...] | list[int]) -> None:
        """``SlotCache.fuse_prefix``, recorded."""
        copied = tuple(self._kept[key] for key in keys)
        super().fuse_prefix(src, dst, keys)
        self._fused_from.append((copied, tuple(keys)))
        self.prefix_runs_fused += 1
        self.prefixes.touch(keys)
        self._ops.append(FusePrefix(src, dst, tuple(keys)))

    def adopt_fused(self) -> None:
        """The slots in use that hold, as their own, the pages the runs fused since the last call were copied from
        take the runs instead (``adopt_run``, recorded): the copies' pages go back to the pool, and no prefix is held
        twice for longer than a step. Called a step after the fusing, whose copy is then done: a worker applies the
        operation once the step before has run (it is not ``UNFENCED``)."""
        with self._lock:
            fused, self._fused_from = self._fused_from, []
            for copied, keys in fused:
                if any(key not in self._kept for key in keys):
                    continue  # evicted meanwhile (its slots ended): nothing to adopt
                for slot, state in enumerate(self._slots):
                    if state.in_use and tuple(state.pages[: len(copied)]) == copied and self.adopt_run(slot, keys):
                        self._ops.append(AdoptRun(slot, keys))

    def _with_whole_runs(self, keys: tuple[int, ...]) -> tuple[int, ...]:
        """``keys`` and the other keys of every fused run one of them holds a page of: the cache holds a run's keys
        all or none (a request maps it whole)."""
        if not self._runs:
            return keys
        more = dict.fromkeys(keys)
        for key in keys:
            if (run := self._runs.get(self._kept[key])) is not None:
                more.update(dict.fromkeys(self._run_keys[run]))
        return tuple(more)

    def map_prefix(self, slot: int, keys: list[int]) -> None:
        """``slot`` (new) starts with the held pages ``keys``: ``SlotCache.map_kept``, recorded."""
        self.map_kept(slot, keys)
        self.prefixes.touch(keys)
        self._ops.append(MapKept(slot, tuple(keys)))

    def cache_pages(self, slot: int, hashes: list[BlockHash], first: int) -> list[int]:
        """Index and hold pages ``first..len(hashes)-1`` of ``slot`` (full: their K/V written, or being written by a
        step already scheduled), but those whose hash is held already; the whole prefix counts as used now. Returns
        the new pages' keys."""
        added = []
        for page in range(first, len(hashes)):
            if hashes[page] not in self.prefixes:
                key = self.prefixes.add(hashes[page])
                self.keep(slot, page, key)
                self._ops.append(KeepPage(slot, page, key))
                added.append(key)
        self.prefixes.touch(self.prefixes.match(hashes))
        return added

    def reset_prefixes(self) -> int:
        """Forget every cached prefix and let go of its pages (those running requests hold stay theirs); returns
        how many were dropped."""
        if self.prefixes is None:
            return 0
        keys = tuple(self.prefixes.eviction_order())
        if keys:
            self._evict(keys)
        return len(keys)

    def eviction_batch(self) -> int:
        """Cached pages an eviction drops at least: the scans ``_evict_for`` makes walk every slot and the index, paid
        once per batch. Four times ``reclaim_batch``, as an evicted page costs the workers nothing until a reclaim
        unmaps it: serving closed loops of 64 / 256 clients behind a full cache (``bench/scheduler_serving.py``, CPU),
        the scheduler's mean step went from 0.94 / 3.55 to 0.69 / 3.22 ms with it, its p99 from 10.5 / 15.7 to
        6.7 / 12.8 ms."""
        return max(1, self._total_pages() // 64)

    def _evict(self, keys: tuple[int, ...]) -> None:
        keys = self._with_whole_runs(keys)
        self.drop_kept(keys)
        self.prefixes.remove(keys)
        self._ops.append(DropKept(keys))

    def _demand(self, state: SlotState, num_tokens: int) -> int:
        """Pages the pool must give to back ``state``'s slot to ``num_tokens``: new ones, and a copy of each shared page
        the writes land in (a scan of the write range only: a decode step's is one page)."""
        need = self.spec.pages_for(num_tokens)
        return max(0, need - len(state.pages)) + len(self._shared_in_write_range(state, need, num_tokens))

    def _evict_for(self, demand: Callable[[], int]) -> None:
        """Before slots are backed: while the pool, with what ``reclaim`` could free, is short of the ``demand()``
        pages they need, drop held pages that no slot in use holds within its tokens, least recently used first.
        (Dropping a page a slot itself holds past its tokens -- a reused slot's old prefix -- spares the copy a write
        into it would have made: ``demand`` is asked again after each batch.)"""
        if self._eager and (short := demand() - self._free_pages()) > 0:
            # Free slots prepared for new requests hold pages alone, and reclaiming them would undo that: first the
            # cached pages nothing else holds (in no slot: dropping one unmaps nothing), least recently used first.
            if keys := self._unheld(max(short, self.eviction_batch())):
                self._evict(keys)
        while True:
            pages = demand()
            if pages <= self._free_pages() or self._reclaims_at_least(pages - self._free_pages()):
                return
            short = pages - self._free_pages() - self._reclaimable()
            if short <= 0:
                return
            used = set()
            for s in self._slots:
                if s.in_use:
                    used.update(s.pages[: self.spec.pages_for(s.tokens)])
            batch = max(short, self.eviction_batch())
            victims = []
            for key in self.prefixes.eviction_order():
                if len(victims) >= batch:
                    break
                if self._kept[key] not in used:
                    victims.append(key)
            if len(victims) < short:
                return  # not enough even with all of them: ensure raises, and the cache keeps them
            self._evict(tuple(victims))

    def record(self, op: KVOp) -> None:
        """Add an operation decided outside the ledger (swap out / in) in its place in the order."""
        self._ops.append(op)

    @property
    def has_ops(self) -> bool:
        return bool(self._ops)

    def take_ops(self) -> tuple[KVOp, ...]:
        """The operations since the last call, in order."""
        ops, self._ops = tuple(self._ops), []
        return ops

    # -- SlotCache hooks: no memory ---------------------------------------------------------
    def _copy(self, slot: int, index: int, src: int, dst: int) -> None:
        pass  # no contents: the workers copy

    def _pool_stats(self) -> tuple[int, int]:
        return 0, 0

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a PageLedger holds no K/V: read a worker's cache")

    def token_rows(self, slot: int, start: int, stop: int) -> torch.Tensor:
        raise TypeError("a PageLedger holds no K/V: read a worker's cache")
