"""KV operations a scheduler decides and every worker applies in the same order.

A scheduler keeps its page accounting in a ``PageLedger``; each call that changes it is recorded as one
of these small messages. A worker replays them on its own cache (``apply_ops``), so every tensor- and
pipeline-parallel shard holds the same slots with the same page counts without asking anyone.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem.slots import Fence, SlotCache
from kvmem.swap import SwapSpace


@dataclass(frozen=True, slots=True)
class AllocSlot:
    slot: int
    expected_tokens: int = 0


@dataclass(frozen=True, slots=True)
class FreeSlot:
    slot: int


@dataclass(frozen=True, slots=True)
class Ensure:
    slot: int
    tokens: int


@dataclass(frozen=True, slots=True)
class SharePrefix:
    src: int
    dst: int
    tokens: int


@dataclass(frozen=True, slots=True)
class SwapOut:
    seq_id: int
    slot: int
    tokens: int


@dataclass(frozen=True, slots=True)
class SwapIn:
    seq_id: int
    slot: int


@dataclass(frozen=True, slots=True)
class DropSwap:
    seq_id: int


@dataclass(frozen=True, slots=True)
class KeepPage:
    """Prefix caching: hold page ``page`` of ``slot`` under ``key`` (``SlotCache.keep``)."""

    slot: int
    page: int
    key: int


@dataclass(frozen=True, slots=True)
class MapKept:
    """Prefix caching: a new slot's first pages are held ones (``SlotCache.map_kept``)."""

    slot: int
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FusePrefix:
    """Prefix caching: ``MapKept(dst, keys)`` with the pages made one allocation first, from ``src``'s
    (``SlotCache.fuse_prefix``)."""

    src: int
    dst: int
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AdoptRun:
    """Prefix caching: ``slot``'s first pages, the ones a fused run was copied from, become that run
    (``SlotCache.adopt_run``). Applied once no queued step reads the slot."""

    slot: int
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DropKept:
    """Prefix caching: evict these pages (``SlotCache.drop_kept``)."""

    keys: tuple[int, ...]


KVOp = (AllocSlot | FreeSlot | Ensure | SharePrefix | SwapOut | SwapIn | DropSwap | KeepPage | MapKept | FusePrefix
        | AdoptRun | DropKept)


def apply_ops(cache: SlotCache, ops: tuple[KVOp, ...] | list[KVOp], swap: SwapSpace | None = None,
              fence: Fence | None = None) -> None:
    """Replay ``ops`` on ``cache`` (and its swap space) in order. ``fence``: queued work that may still read the
    slots these ops free (``SlotCache.free_slot``)."""
    for op in ops:
        match op:
            case Ensure(slot, tokens):
                cache.ensure(slot, tokens)
            case AllocSlot(slot, expected):
                cache.alloc_slot(expected, slot=slot)
            case FreeSlot(slot):
                cache.free_slot(slot, fence)
            case SharePrefix(src, dst, tokens):
                cache.share_prefix(src, dst, tokens)
            case KeepPage(slot, page, key):
                cache.keep(slot, page, key)
            case MapKept(slot, keys):
                cache.map_kept(slot, keys)
            case FusePrefix(src, dst, keys):
                cache.fuse_prefix(src, dst, keys)
            case AdoptRun(slot, keys):
                cache.adopt_run(slot, keys)
            case DropKept(keys):
                cache.drop_kept(keys)
            case SwapOut(seq_id, slot, tokens):
                _swap(swap, op).swap_out(seq_id, slot, tokens)
            case SwapIn(seq_id, slot):
                _swap(swap, op).swap_in(seq_id, slot)
            case DropSwap(seq_id):
                _swap(swap, op).drop(seq_id)
            case _:
                raise TypeError(f"not a KV operation: {op!r}")


def _swap(swap: SwapSpace | None, op: KVOp) -> SwapSpace:
    if swap is None:
        raise ValueError(f"{op} needs a swap space, and this cache has none")
    return swap
