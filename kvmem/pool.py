"""PagePool: physical pages created ahead of time, so mapping never waits for an allocation."""

from __future__ import annotations

from typing import Any

from kvmem.errors import KVCacheExhausted
from kvmem.vmm import VMM


class PagePool:
    """Physical pages of ``page_size`` bytes, named by int ids; grows and shrinks at run time."""

    def __init__(self, vmm: VMM, page_size: int, num_pages: int = 0):
        self._vmm = vmm
        self.page_size = page_size
        self._handles: dict[int, Any] = {}
        self._free: list[int] = []
        self._next_id = 0
        # Pages fused into one allocation (``fuse``): each member's run, and each run's handle.
        self._runs: dict[int, tuple[int, ...]] = {}
        self._fused: dict[tuple[int, ...], Any] = {}
        self.grow(num_pages)

    @property
    def num_pages(self) -> int:
        return len(self._handles) + len(self._runs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def handle(self, page: int) -> Any:
        if page in self._runs:
            raise ValueError(f"page {page} is fused with {self._runs[page]}: it maps only with them (run_handle)")
        return self._handles[page]

    def fuse(self, pages: tuple[int, ...]) -> None:
        """Make ``pages`` (handed out, mapped nowhere) one allocation, mapped whole from then on (``run_handle``): the
        driver's price of a mapping goes with the allocations, not the bytes (bench/vmm_run_costs.py), so a run mapped
        often is cheaper as one. Their memory is given back and taken again as one piece."""
        if len(pages) < 2 or len(set(pages)) != len(pages) or any(
                p in self._runs or p not in self._handles or p in self._free for p in pages):
            raise ValueError(f"fuse: {pages} are not two or more distinct pages, handed out and not fused")
        for page in pages:
            self._vmm.release(self._handles.pop(page))
        try:
            self._fused[pages] = self._vmm.create(self.page_size * len(pages))
        except BaseException:
            for page in pages:  # the memory just given back: as it was
                self._handles[page] = self._vmm.create(self.page_size)
            raise
        for page in pages:
            self._runs[page] = pages

    def run_handle(self, pages: tuple[int, ...]) -> Any:
        """The allocation ``fuse(pages)`` made."""
        return self._fused[pages]

    def unfuse(self, pages: tuple[int, ...]) -> None:
        """Undo ``fuse(pages)``: the pages are allocations of their own again. Where the run is still mapped (a stale
        mapping that queued work may read), its memory stays until that mapping goes."""
        self._vmm.release(self._fused.pop(pages))
        for page in pages:
            del self._runs[page]
            self._handles[page] = self._vmm.create(self.page_size)

    def take(self, n: int) -> tuple[int, ...]:
        """Hand out ``n`` free pages; raises ``KVCacheExhausted`` (taking none) if fewer are free."""
        if n > len(self._free):
            raise KVCacheExhausted(n, len(self._free))
        taken = tuple(self._free[-n:]) if n else ()
        del self._free[len(self._free) - n:]
        return taken

    def give(self, pages: tuple[int, ...]) -> None:
        """Take back pages that are mapped nowhere any more."""
        self._free.extend(pages)

    def grow(self, n: int) -> int:
        """Create ``n`` more pages; all or none (a failure releases what this call created)."""
        created: list[int] = []
        try:
            for _ in range(n):
                self._handles[self._next_id] = self._vmm.create(self.page_size)
                created.append(self._next_id)
                self._next_id += 1
        except BaseException:
            for page in created:
                self._vmm.release(self._handles.pop(page))
            raise
        self._free.extend(reversed(created))
        return n

    def shrink(self, n: int) -> int:
        """Release up to ``n`` free pages to the system; returns how many were released."""
        released = 0
        while released < n and self._free:
            self._vmm.release(self._handles.pop(self._free.pop(0)))
            released += 1
        return released

    def close(self) -> None:
        """Release every page; the caller has unmapped them all."""
        for handle in (*self._handles.values(), *self._fused.values()):
            self._vmm.release(handle)
        self._handles.clear()
        self._fused.clear()
        self._runs.clear()
        self._free.clear()
