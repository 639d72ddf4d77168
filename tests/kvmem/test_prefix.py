"""Prefix caching in kvmem: the chained block hashes, the index's eviction order, a cache holding blocks past
their slot and mapping them into another (real HostVMM: the same physical pages at two offsets), and the ledger
evicting held blocks -- least recently used, deepest first, never one a running slot holds -- when memory is short."""

from __future__ import annotations

import pytest
import torch

from kvmem import KVCacheError, KVCacheExhausted, VirtualKVCache
from kvmem.ledger import PageLedger
from kvmem.ops import DropKept, Ensure, KeepBlock, MapKept, apply_ops
from kvmem.prefix import PrefixIndex, extend_block_hashes
from kvmem.spec import KVCacheSpec
from tests.conftest import check_invariants
from tests.kvmem.test_cache import assert_holds, fill

SPEC = KVCacheSpec(2, 2, 16, torch.float32, max_slots=4, max_tokens=256, layout="mega", page_size=4096)  # 16 tokens/page


def test_a_block_hash_covers_everything_before_it_and_the_salt():
    ids = list(range(100, 140))
    hashes = extend_block_hashes([], ids, 16)
    assert len(hashes) == 2  # the 8 tokens past the second block are no full block
    assert extend_block_hashes(hashes[:1], ids, 16) == hashes  # extending is hashing from the start
    changed = extend_block_hashes([], ids[:3] + [0] + ids[4:], 16)
    assert changed[0] != hashes[0] and changed[1] != hashes[1]  # the second block's tokens are equal, its prefix not
    salted = extend_block_hashes([], ids, 16, salt="tenant-a")
    assert not set(salted) & set(hashes) and salted != extend_block_hashes([], ids, 16, salt="tenant-b")
    assert extend_block_hashes(hashes, ids + [1] * 24, 16)[2:] == extend_block_hashes([], ids + [1] * 24, 16)[2:]


def test_the_index_evicts_the_least_recently_used_prefix_from_its_end():
    index = PrefixIndex()
    a = [index.add(h) for h in (b"a0", b"a1", b"a2")]
    index.touch(a)
    b = [index.add(h) for h in (b"b0", b"b1")]
    index.touch(b)
    assert list(index.eviction_order()) == [a[2], a[1], a[0], b[1], b[0]]
    index.touch(a[:2])  # a request found a's first two blocks
    assert list(index.eviction_order()) == [a[2], b[1], b[0], a[1], a[0]]
    assert index.match([b"a0", b"a1", b"x", b"a2"]) == a[:2]
    index.remove([a[2]])
    assert index.match([b"a0", b"a1", b"a2"]) == a[:2] and len(index) == 4
    with pytest.raises(KeyError, match="indexed already"):
        index.add(b"a0")


@pytest.mark.parametrize("layout", ["mega", "per_layer"])
def test_kept_blocks_outlive_their_slot_and_map_into_another_without_a_copy(cache_factory, layout):
    cache = cache_factory(layout, pool_groups=8)
    block = cache.spec.prefix_block_tokens
    a = cache.alloc_slot(3 * block)
    cache.ensure(a, 2 * block + 3)
    fill(cache, a, 0, 2 * block + 3, tag=10.0)
    with pytest.raises(ValueError, match="block 2 of slot 0 is not full"):
        cache.keep(a, 2, key=9)
    cache.keep(a, 0, key=0)
    cache.keep(a, 1, key=1)
    with pytest.raises(KVCacheError, match="key 1 already holds a block"):
        cache.keep(a, 1, key=1)
    cache.free_slot(a)
    cache.reclaim(10**6)  # the free slot lets go of its pages; the held blocks stay
    assert cache.kept_blocks() == 2 and cache.stats().mapped_bytes == 2 * cache.spec.prefix_block_pages * (
        cache.spec.page_size * cache.spec.num_buffers)
    b = cache.alloc_slot(3 * block)
    cache.map_kept(b, [0, 1])
    assert cache.num_tokens(b) == 2 * block
    assert_holds(cache, b, 0, 2 * block, tag=10.0)  # the K/V slot a wrote, read through slot b's offsets
    cache.ensure(b, 2 * block + 5)  # past the held blocks: fresh pages, no copy of a shared one
    fill(cache, b, 2 * block, 2 * block + 5, tag=10.0)
    assert_holds(cache, b, 0, 2 * block + 5, tag=10.0)
    with pytest.raises(ValueError, match=f"slot {b} holds {2 * block + 5} tokens already"):
        cache.map_kept(b, [0])
    with pytest.raises(KVCacheError, match=r"no block is kept under keys \[5\]"):
        cache.drop_kept([5])
    check_invariants(cache)
    cache.drop_kept([0, 1])
    cache.free_slot(b)
    cache.reclaim(10**6)
    assert cache.stats().mapped_bytes == 0 and cache.kept_blocks() == 0
    check_invariants(cache)


def _ledger(pages: int) -> PageLedger:
    return PageLedger(SPEC, pages, keeps_pages_on_free=True, caches_prefixes=True)


def _run(ledger: PageLedger, tokens: int, hashes: list[bytes]) -> int:
    """A request of ``tokens`` tokens whose full blocks are ``hashes``: computed, cached, finished."""
    slot = ledger.alloc_slot(tokens)
    ledger.ensure(slot, tokens)
    ledger.cache_blocks(slot, hashes, 0)
    ledger.free_slot(slot)
    return slot


def test_the_ledger_evicts_cached_blocks_nothing_holds_least_recently_used_first_and_the_workers_follow():
    ledger, cache = _ledger(6), VirtualKVCache(SPEC, 6 * SPEC.num_buffers * SPEC.page_size)
    first, second = _run(ledger, 32, [b"a0", b"a1"]), _run(ledger, 32, [b"b0", b"b1"])
    ledger.map_prefix(ledger.alloc_slot(64), ledger.cached_prefix([b"a0", b"a1"]))  # a is used again
    ops = ledger.take_ops()
    assert [op for op in ops if isinstance(op, KeepBlock)] == [KeepBlock(first, 0, 0), KeepBlock(first, 1, 1),
                                                               KeepBlock(second, 0, 2), KeepBlock(second, 1, 3)]
    assert MapKept(first, (0, 1)) in ops  # the free slot that holds a's pages already: nothing to map
    apply_ops(cache, ops)
    running = next(i for i, s in enumerate(ledger._slots) if s.in_use)
    # 6 pages: 4 held (a's two by the running slot too), 2 free. 3 more for the running slot: one block is
    # evicted, b's last (b was used before a, and a prefix shrinks from its end).
    ledger.ensure(running, 32 + 3 * 16)
    ops = ledger.take_ops()
    assert ops == (DropKept((3,)), Ensure(running, 80))
    assert ledger.cached_prefix([b"b0", b"b1"]) == [2] and ledger.cached_prefix([b"a0", b"a1"]) == [0, 1]
    apply_ops(cache, ops)
    assert cache.accounting() == ledger.accounting()
    # Two more pages: b's first block is one, and a's are held by the running slot (never evicted): nothing is
    # evicted for a request that would not fit anyway.
    with pytest.raises(KVCacheExhausted):
        ledger.ensure(running, 32 + 5 * 16)
    assert ledger.take_ops() == () and ledger.cached_prefix([b"b0"]) == [2]
    check_invariants(cache)


def test_a_reset_drops_every_held_block_and_the_pool_comes_back():
    ledger, cache = _ledger(8), VirtualKVCache(SPEC, 8 * SPEC.num_buffers * SPEC.page_size)
    _run(ledger, 40, [b"a0", b"a1"])
    _run(ledger, 20, [b"b0"])
    assert ledger.reset_prefixes() == 3 and ledger.reset_prefixes() == 0
    apply_ops(cache, ledger.take_ops())
    assert cache.accounting() == ledger.accounting() and cache.kept_blocks() == 0
    cache.reclaim(10**6)
    assert cache.stats().mapped_bytes == 0
