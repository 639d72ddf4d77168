"""Prefix caching's index: which full pages the cache holds, found by a chained hash of their tokens.

The unit is a page of the cache: 32 tokens of ``llama-3-8b`` in ``mega`` 2 MiB pages, a 16-token block of ``paged``.
A page's hash covers the hash of the page before it, the cache salt and the ids of the tokens with bytes in it
(vLLM's scheme, per block), so equal hashes mean equal prefixes, not only equal pages. Where a page does not hold
whole tokens, the token that runs over its end is in the hashes of both pages. SHA-256, not Python's ``hash``: a
collision would hand one request another's K/V, and prompts are chosen by clients.

The index knows hashes and keys only; the page behind a key is the ledger's (``PageLedger``) and, replayed, each
worker's (``SlotCache.keep``).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvmem.spec import KVCacheSpec

BlockHash = bytes


def extend_page_hashes(hashes: list[BlockHash], token_ids: Sequence[int], spec: KVCacheSpec,
                       salt: str | None = None) -> list[BlockHash]:
    """Append to ``hashes`` (those of the first pages ``token_ids`` fill) the hash of every further page they fill."""
    salted = salt.encode() if salt else b""
    while True:
        start, stop = spec.page_tokens(len(hashes))
        if stop > len(token_ids):
            return hashes
        h = hashlib.sha256(hashes[-1] if hashes else b"")
        h.update(len(salted).to_bytes(4, "little") + salted)
        h.update(array("q", token_ids[start:stop]).tobytes())
        hashes.append(h.digest())


class PrefixIndex:
    """Page hash -> key of the page the cache holds, with the order eviction takes them in: least recently used
    first and, among pages used together, the one furthest from the start first (vLLM's order), so a prefix
    shrinks from its end and what is left of it is still found."""

    def __init__(self) -> None:
        self._keys: dict[BlockHash, int] = {}
        self._lru: OrderedDict[int, BlockHash] = OrderedDict()  # key -> hash, the next to evict first
        self._next = itertools.count()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, block: BlockHash) -> bool:
        return block in self._keys

    def match(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Keys of the longest run of ``hashes``, from the first, that the index holds."""
        keys = []
        for h in hashes:
            key = self._keys.get(h)
            if key is None:
                break
            keys.append(key)
        return keys

    def add(self, block: BlockHash) -> int:
        """A new key for ``block`` (which the index must not hold), used now."""
        if block in self._keys:
            raise KeyError(f"page {block.hex()[:16]} is indexed already")
        key = next(self._next)
        self._keys[block] = key
        self._lru[key] = block
        return key

    def touch(self, keys: Sequence[int]) -> None:
        """``keys`` (a prefix's pages, in order) were used now: last to be evicted, the last page first."""
        for key in reversed(keys):
            self._lru.move_to_end(key)

    def eviction_order(self) -> Iterable[int]:
        """Every key, the first to evict first."""
        return iter(self._lru)

    def remove(self, keys: Iterable[int]) -> None:
        for key in keys:
            del self._keys[self._lru.pop(key)]
