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
        self.grow(num_pages)

    @property
    def num_pages(self) -> int:
        return len(self._handles)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def handle(self, page: int) -> Any:
        return self._handles[page]

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
        for handle in self._handles.values():
            self._vmm.release(handle)
        self._handles.clear()
        self._free.clear()
