"""VirtualKVCache: K/V buffers reserved as contiguous virtual memory, backed page by page on demand."""

from __future__ import annotations

import time

import torch

from kvmem.errors import KVCacheError, VMMError
from kvmem.pool import PagePool
from kvmem.slots import SlotCache, consecutive_runs
from kvmem.spec import KVCacheSpec
from kvmem.vmm import VMM, default_vmm

Group = tuple[int, ...]  # one physical page per buffer, all at the same slot page index


class VirtualKVCache(SlotCache):
    """The vAttention cache: attention kernels read plain ``[slot, token, head, dim]`` tensors.

    Each buffer (2 per layer, or one K and one V for ``mega``) is one virtual reservation of
    ``max_slots`` slot rows. Page i of a slot is a group of physical pages, one per buffer, mapped at the
    same offset of every buffer, so a slot's tokens are backed in all layers at once.

    ``vmm`` defaults to host memory (``HostVMM``); pass ``CudaVMM`` for the GPU. The cache closes only a
    backend it created. ``pool_bytes`` of physical pages are created up front (``grow``/``shrink`` change that later).
    ``zero_unmapped`` maps a shared read-only zero page over every unmapped page, so a stray read of a
    view sees zeros rather than faulting (free on the host; on the GPU it adds a map per unmap and an
    unmap per map -- see bench/README.md for the measured cost).
    """

    defers_unmaps = True
    fuses_runs = True

    def __init__(
        self,
        spec: KVCacheSpec,
        pool_bytes: int,
        vmm: VMM | None = None,
        *,
        zero_unmapped: bool = True,
        guard_tokens: int | None = None,
        deferred_reclamation: bool = True,
        background_unmaps: bool = False,
    ):
        """``deferred_reclamation``: a freed slot keeps its pages mapped for the next request (the paper's
        deferred reclamation); False unmaps them at once (for measuring what that saves). ``guard_tokens`` (with
        ``zero_unmapped``): the zero page backs only that many tokens past each slot's last mapped page -- as far
        as a kernel's tile may read past a sequence -- and the rest of unmapped space stays unbacked, which spares
        most of the zero page's driver calls (an attach unmaps one zero run, a detach maps back only a guard's worth).
        ``background_unmaps``: pages let go of stay mapped until ``unmap_stale`` (``SlotCache.unmaps_in_background``;
        give the cache an ``AsyncMapper`` and call its ``clean`` between steps)."""
        if spec.layout == "paged":
            raise ValueError("VirtualKVCache takes layout 'per_layer' or 'mega'; use PagedKVCache for 'paged'")
        if pool_bytes < 0:
            raise ValueError(f"pool_bytes must be >= 0, got {pool_bytes}")
        super().__init__(spec)
        self.keeps_pages_on_free = deferred_reclamation
        self.unmaps_in_background = background_unmaps
        self._owns_vmm = vmm is None
        self._vmm = vmm if vmm is not None else default_vmm()
        if spec.page_size % self._vmm.granularity:
            raise ValueError(
                f"page_size={spec.page_size} is not a multiple of the backend granularity {self._vmm.granularity}"
            )
        self.units_per_page = spec.num_buffers
        self.zero_unmapped = zero_unmapped
        if guard_tokens is not None and (isinstance(guard_tokens, bool) or not isinstance(guard_tokens, int)
                                         or guard_tokens < 1 or not zero_unmapped):
            raise ValueError(f"guard_tokens must be None or an int >= 1 with zero_unmapped, got {guard_tokens!r} "
                             f"(zero_unmapped={zero_unmapped})")
        # Zero pages past a slot's mapped ones (all of its unmapped pages without a guard).
        self._guard = (spec.pages_per_slot if guard_tokens is None
                       else min(spec.pages_per_slot, -(-guard_tokens * spec.token_bytes // spec.page_bytes)))
        self._bases: list[int] = []
        self._reserve_all()
        self._flat = [self._vmm.tensor(base, spec.buffer_bytes) for base in self._bases]
        self._scratch_va = self._vmm.reserve(spec.page_size)
        self._scratch = self._vmm.tensor(self._scratch_va, spec.page_size)
        self._views = [self._view(i) for i in range(spec.num_buffers)]
        # The attention step asks for every layer's rows every step: built once, they are fixed views.
        self._rows = [(self._buffer_view(i, 0).flatten(0, 1), self._buffer_view(i, 1).flatten(0, 1))
                      for i in range(spec.num_layers)]
        self._pool = PagePool(self._vmm, spec.page_size, pool_bytes // spec.page_size)

    @property
    def device(self) -> torch.device:
        return self._vmm.device

    # -- set-up --------------------------------------------------------------------------------
    def _reserve_all(self) -> None:
        spec = self.spec
        try:
            for _ in range(spec.num_buffers):
                self._bases.append(self._vmm.reserve(spec.buffer_bytes))
                if self.zero_unmapped:
                    for slot in range(spec.max_slots):
                        self._vmm.map_zero(self._bases[-1] + self._offset(slot, 0), spec.page_size, self._guard)
        except VMMError as exc:
            self._free_reservations()
            raise KVCacheError(
                f"the spec does not fit the virtual address space: {spec.num_buffers} buffers of "
                f"{spec.buffer_bytes} bytes (max_slots={spec.max_slots} x slot_tokens={spec.slot_tokens} x "
                f"{spec.token_bytes} bytes/token), {spec.reserved_bytes} bytes in all: {exc}"
            ) from exc

    def _free_reservations(self) -> None:
        for base in self._bases:
            if self.zero_unmapped:  # every slot holds no page now: its guard is its first pages
                for slot in range(self.spec.max_slots):
                    self._vmm.unmap(base + self._offset(slot, 0), self.spec.page_size * self._guard)
            self._vmm.free(base, self.spec.buffer_bytes)
        self._bases.clear()

    def _view(self, buffer: int) -> torch.Tensor:
        s = self.spec
        return self._flat[buffer].view(s.dtype).view(s.max_slots, s.slot_tokens, s.layers_per_buffer, s.num_kv_heads, s.head_dim)

    # -- tensors -------------------------------------------------------------------------------
    def k(self, layer: int) -> torch.Tensor:
        """K of ``layer``: ``[max_slots, max_tokens, num_kv_heads, head_dim]`` over virtual memory."""
        return self._layer_view(layer, 0)

    def v(self, layer: int) -> torch.Tensor:
        """V of ``layer``: ``[max_slots, max_tokens, num_kv_heads, head_dim]`` over virtual memory."""
        return self._layer_view(layer, 1)

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` as ``[max_slots * slot_tokens, H, D]``: token t of slot s is row
        ``s * spec.slot_tokens + t`` (the layout varlen attention kernels take, no copy)."""
        self._check_layer(layer)
        return self._rows[layer]

    def token_rows(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Row indices (see ``rows``) of tokens ``[start, stop)`` of ``slot``."""
        first = slot * self.spec.slot_tokens
        return torch.arange(first + start, first + stop)

    def _layer_view(self, layer: int, kv: int) -> torch.Tensor:
        return self._buffer_view(layer, kv)[:, : self.spec.max_tokens]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.spec.num_layers})")

    def _buffer_view(self, layer: int, kv: int) -> torch.Tensor:
        self._check_layer(layer)
        if self.spec.layout == "per_layer":
            return self._views[kv * self.spec.num_layers + layer][:, :, 0]
        return self._views[kv][:, :, layer]

    # -- pool ----------------------------------------------------------------------------------
    def grow(self, nbytes: int) -> int:
        """Create physical pages for ``nbytes`` more (rounded up to pages); returns bytes added."""
        if nbytes < 0:
            raise ValueError(f"grow: nbytes must be >= 0, got {nbytes}")
        with self._lock:
            return self._pool.grow(-(-nbytes // self.spec.page_size)) * self.spec.page_size

    def shrink(self, nbytes: int) -> int:
        """Release up to ``nbytes`` of unmapped pages to the system; returns the bytes released."""
        if nbytes < 0:
            raise ValueError(f"shrink: nbytes must be >= 0, got {nbytes}")
        with self._lock:
            self._unmap_stale(done_only=False)  # a free page may still be mapped where queued work reads it
            return self._pool.shrink(nbytes // self.spec.page_size) * self.spec.page_size

    # -- SlotCache hooks -----------------------------------------------------------------------
    def _take(self, n: int) -> list[Group]:
        nb = self.units_per_page
        flat = self._pool.take(n * nb)
        return [flat[i : i + nb] for i in range(0, n * nb, nb)]

    def _give(self, page: Group) -> None:
        self._pool.give(page)

    def _free_units(self) -> int:
        return self._pool.num_free

    def _total_units(self) -> int:
        return self._pool.num_pages

    def _offset(self, slot: int, index: int) -> int:
        """Byte offset of page ``index`` of ``slot`` within every buffer."""
        return slot * self.spec.slot_bytes + index * self._page_bytes

    def _va(self, buffer: int, slot: int, index: int) -> int:
        return self._bases[buffer] + self._offset(slot, index)

    def _attach(self, slot: int, index: int, page: Group) -> None:
        self._attach_run(slot, index, [page])

    def _attach_run(self, slot: int, first: int, pages: list[Group]) -> None:
        # The hot path of ensure() (a prefill chunk, decode growth, a cached prefix): pages appended at ``first``, the
        # slot's end. Per buffer: one unmap of the zero pages there (H100: 61 us a page in all, against 69 a page at a
        # time), one mapping of the run with one access call (``_map_pages``), and the guard moved past the run.
        size, vmm, n, last = self._page_bytes, self._vmm, len(pages), self.spec.pages_per_slot
        start = time.perf_counter()
        for buffer, base in enumerate(self._bases):
            if self.zero_unmapped:
                vmm.unmap(base + self._offset(slot, first), size * (min(first + n, first + self._guard, last) - first))
            self._map_pages(buffer, slot, first, pages)
            guard = max(first + n, first + self._guard)
            if self.zero_unmapped and guard < min(first + n + self._guard, last):
                vmm.map_zero(base + self._offset(slot, guard), size, min(first + n + self._guard, last) - guard)
        each = (time.perf_counter() - start) * 1e6 / n
        self._counters.map_latency_us.extend([each] * n)
        self._counters.maps += n

    def _swap(self, slot: int, changes: list[tuple[int, Group, Group]]) -> None:
        # A cached prefix mapped over a reused slot's own pages: per run of consecutive pages, one unmap of the old
        # and one mapping of the new -- no zero page in between (that would double the driver calls).
        size, vmm = self._page_bytes, self._vmm
        new = {index: page for index, _, page in changes}
        runs = consecutive_runs(list(new))
        start = time.perf_counter()
        for buffer, base in enumerate(self._bases):
            for run in runs:
                vmm.unmap(base + self._offset(slot, run[0]), size * len(run))
                self._map_pages(buffer, slot, run[0], [new[index] for index in run])
        each = (time.perf_counter() - start) * 1e6 / len(changes)
        self._counters.map_latency_us.extend([each] * len(changes))
        self._counters.maps += len(changes)
        self._counters.unmaps += len(changes)

    def _map_pages(self, buffer: int, slot: int, first: int, pages: list[Group]) -> None:
        """Map ``pages`` at pages ``first, first + 1, ...`` of ``slot`` in ``buffer`` (unbacked there): a run of pages
        of their own with one access call, a fused run as its one allocation."""
        size, vmm, base, i = self._page_bytes, self._vmm, self._bases[buffer], 0
        while i < len(pages):
            run = self._runs.get(pages[i])
            if run is None:
                end = next((j for j in range(i, len(pages)) if pages[j] in self._runs), len(pages))
                vmm.map_run(base + self._offset(slot, first + i), size,
                            [self._pool.handle(page[buffer]) for page in pages[i:end]])
                i = end
                continue
            if tuple(pages[i : i + len(run)]) != run:
                raise KVCacheError(f"slot {slot}: pages {first + i}.. hold part of a fused run, which maps whole")
            vmm.map_run(base + self._offset(slot, first + i), size * len(run),
                        [self._pool.run_handle(tuple(page[buffer] for page in run))])
            i += len(run)

    def _fuse(self, run: tuple[Group, ...]) -> None:
        for buffer in range(len(self._bases)):
            self._pool.fuse(tuple(page[buffer] for page in run))

    def _unfuse(self, run: tuple[Group, ...]) -> None:
        for buffer in range(len(self._bases)):
            self._pool.unfuse(tuple(page[buffer] for page in run))

    def _copy_prefix(self, src: int, dst: int, pages: int) -> None:
        # Queued on the device behind the work that wrote ``src`` (no wait); ``src``'s mappings stay until it is done.
        n, a, b = pages * self._page_bytes, self._offset(src, 0), self._offset(dst, 0)
        for flat in self._flat:
            flat[b : b + n].copy_(flat[a : a + n], non_blocking=True)
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._slots[src].fence = done

    def _detach(self, slot: int, index: int, page: Group) -> None:
        self._detach_run(slot, index, [page])

    def _detach_run(self, slot: int, first: int, pages: list[Group]) -> None:
        # The slot's last pages, from ``first`` on: per buffer one unmap over them, the zero page back over the guard's
        # worth of them, and the part of the old guard past the new one unmapped.
        size, vmm, n, last = self._page_bytes, self._vmm, len(pages), self.spec.pages_per_slot
        for base in self._bases:
            vmm.unmap(base + self._offset(slot, first), size * n)
            if self.zero_unmapped:
                vmm.map_zero(base + self._offset(slot, first), size, min(n, self._guard))
                stale = max(first + n, first + self._guard)
                if stale < min(first + n + self._guard, last):
                    vmm.unmap(base + self._offset(slot, stale), size * (min(first + n + self._guard, last) - stale))
        self._counters.unmaps += n

    def _copy(self, slot: int, index: int, src: Group, dst: Group) -> None:
        size, offset = self._page_bytes, self._offset(slot, index)
        for buffer, physical in enumerate(dst):
            self._vmm.map(self._scratch_va, size, self._pool.handle(physical))
            self._vmm.copy(self._scratch, self._flat[buffer][offset : offset + size])
            self._vmm.unmap(self._scratch_va, size)

    def _pool_stats(self) -> tuple[int, int]:
        return self.spec.reserved_bytes, self._pool.num_pages * self.spec.page_size

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap everything and give all memory back. Views taken from this cache are invalid after."""
        with self._lock:
            if not self._bases:
                return
            for slot, state in enumerate(self._slots):
                self._drop_tail(slot, 0)
                state.in_use, state.tokens = False, 0
            self._unmap_stale(done_only=False)
            self._pool.close()
            self._vmm.free(self._scratch_va, self.spec.page_size)
            self._free_reservations()
            if self._owns_vmm:
                self._vmm.close()
