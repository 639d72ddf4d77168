"""PageLedger: a scheduler's page accounting -- ``SlotCache`` bookkeeping with no memory behind it."""

from __future__ import annotations

import torch

from kvmem.errors import KVCacheExhausted
from kvmem.ops import AllocSlot, Ensure, FreeSlot, KVOp, SharePrefix
from kvmem.slots import Fence, NumberedSlotCache
from kvmem.spec import KVCacheSpec


class PageLedger(NumberedSlotCache):
    """Slots, page counts, refcounts and deferred reclamation exactly as a worker's cache keeps them,
    over ``num_pages`` numbered pages that back nothing.

    Every change (alloc, free, ensure, share) is recorded as a ``KVOp``; ``take_ops`` hands the list to
    the workers, which replay it on their real caches (``kvmem.ops.apply_ops``) and so stay in step.
    ``keeps_pages_on_free`` follows the workers' caches: True for the virtual layouts, False for paged.
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int, keeps_pages_on_free: bool):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        super().__init__(spec, num_pages)
        self.keeps_pages_on_free = keeps_pages_on_free
        self._ops: list[KVOp] = []

    # -- recorded changes ----------------------------------------------------------------------
    def alloc_slot(self, expected_tokens: int = 0, slot: int | None = None) -> int:
        slot = super().alloc_slot(expected_tokens, slot)
        self._ops.append(AllocSlot(slot, expected_tokens))
        return slot

    def free_slot(self, slot: int, fence: Fence | None = None) -> None:
        super().free_slot(slot, fence)
        self._ops.append(FreeSlot(slot))

    def ensure(self, slot: int, num_tokens: int) -> None:
        """``SlotCache.ensure``. A call that changes nothing (mapped ahead already) is not recorded."""
        unchanged = self.num_tokens(slot) == num_tokens
        super().ensure(slot, num_tokens)
        if not unchanged:
            self._ops.append(Ensure(slot, num_tokens))

    def ensure_ahead(self, slot: int, num_tokens: int) -> bool:
        """Back ``slot`` up to ``num_tokens`` for mapping ahead, unrecorded (the plan travels apart, as a
        ``MappingPlan``); False, with nothing done, where the pool is short or a shared page would have to be
        copied -- that copy would run on the workers' mapper threads beside the step still writing the page."""
        self._check_tokens(num_tokens, "num_tokens")
        with self._lock:
            if self._shared_in_write_range(self._in_use(slot), self.spec.pages_for(num_tokens), num_tokens):
                return False
            try:
                super().ensure(slot, num_tokens)
            except KVCacheExhausted:
                return False
            return True

    def share_prefix(self, src: int, dst: int, tokens: int) -> None:
        super().share_prefix(src, dst, tokens)
        self._ops.append(SharePrefix(src, dst, tokens))

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
