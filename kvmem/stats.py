"""Counters and the stats snapshot every KV cache reports, virtual or paged alike."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PageMap:
    """Every slot's virtual range, page by page, one character a page: ``U`` maps memory holding tokens, ``S`` the
    same memory shared with another slot (a cached or forked prefix, copy-on-write), ``C`` memory the prefix cache
    holds too (a free slot's: kept for a request that starts the same way), ``M`` maps memory holding no token (a
    slot's tail, or pages a free slot keeps for its next request), ``.`` is reserved address space only."""

    page_bytes: int  # of one page in one buffer
    slots: tuple[str, ...]
    in_use: tuple[bool, ...]

    def count(self, state: str) -> int:
        return sum(s.count(state) for s in self.slots)


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of a cache's memory and mapping activity. Bytes are over all buffers."""

    reserved_bytes: int  # virtual space reserved (paged: the block pool)
    pool_bytes: int  # physical pages that exist
    mapped_bytes: int  # physical pages in use by slots (mapped / allocated blocks)
    used_bytes: int  # bytes holding valid tokens
    free_pages: int
    slots_in_use: int
    maps: int
    unmaps: int
    map_latency_us: tuple[float, ...]  # recent samples, one per mapped page group
    stall_seconds: float

    @property
    def fragmentation(self) -> float:
        """1 - used/mapped: the share of mapped memory that holds no valid token."""
        return 1.0 - self.used_bytes / self.mapped_bytes if self.mapped_bytes else 0.0

    @property
    def map_latency_p50_us(self) -> float:
        return statistics.median(self.map_latency_us) if self.map_latency_us else 0.0


@dataclass
class Counters:
    """Mutable activity counters a cache keeps (under its lock)."""

    maps: int = 0
    unmaps: int = 0
    mappings: int = 0  # allocations mapped: a page, or a fused run's pages together
    stall_seconds: float = 0.0
    map_latency_us: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


@dataclass(frozen=True)
class SlotAccounting:
    """The bookkeeping state of a cache, independent of which physical pages back it."""

    slots: tuple[tuple[bool, int, int], ...]  # (in use, tokens, pages) per slot
    free_pages: int  # slot pages the pool can hand out
    shared_pages: int  # pages with more than one reference
    kept_pages: int = 0  # pages the prefix cache holds for later requests
