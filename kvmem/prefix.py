"""Prefix caching's index: which full prefix blocks the cache holds, found by a chained hash of their tokens.

A block is ``KVCacheSpec.prefix_block_tokens`` tokens (a page of ``mega`` 2 MiB pages on an 8B model: 32 tokens).
Its hash covers the hash of the block before it, the cache salt and its token ids (vLLM's scheme), so equal hashes
mean equal prefixes, not only equal blocks. SHA-256, not Python's ``hash``: a collision would hand one request
another's K/V, and prompts are chosen by clients.

The index knows hashes and keys only; the pages behind a key are the ledger's (``PageLedger``) and, replayed, each
worker's (``SlotCache.keep``).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_tokens: int,
                        salt: str | None = None) -> list[BlockHash]:
    """Append to ``hashes`` (those of the first blocks of ``token_ids``) the hash of every further full block."""
    salted = salt.encode() if salt else b""
    for start in range(len(hashes) * block_tokens, len(token_ids) - block_tokens + 1, block_tokens):
        h = hashlib.sha256(hashes[-1] if hashes else b"")
        h.update(len(salted).to_bytes(4, "little") + salted)
        h.update(array("q", token_ids[start : start + block_tokens]).tobytes())
        hashes.append(h.digest())
    return hashes


class PrefixIndex:
    """Block hash -> key of the block the cache holds, with the order eviction takes them in: least recently used
    first and, among blocks used together, the one furthest from the start first (vLLM's order), so a prefix
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
            raise KeyError(f"block {block.hex()[:16]} is indexed already")
        key = next(self._next)
        self._keys[block] = key
        self._lru[key] = block
        return key

    def touch(self, keys: Sequence[int]) -> None:
        """``keys`` (a prefix's blocks, in order) were used now: last to be evicted, the last block first."""
        for key in reversed(keys):
            self._lru.move_to_end(key)

    def eviction_order(self) -> Iterable[int]:
        """Every key, the first to evict first."""
        return iter(self._lru)

    def remove(self, keys: Iterable[int]) -> None:
        for key in keys:
            del self._keys[self._lru.pop(key)]
