"""PagedKVCache: the PagedAttention baseline keeps the same accounting and sharing rules."""

from __future__ import annotations

import weakref

import pytest
import torch

from kvmem import KVCacheExhausted, KVCacheSpec, PagedKVCache, paged_spec
from tests.conftest import check_invariants

SPEC = paged_spec(2, 2, 4, dtype=torch.float32, max_slots=4, max_tokens=128)


def make(blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(SPEC, blocks * SPEC.page_size * SPEC.bytes_per_token)


def kv(n: int, start: float) -> torch.Tensor:
    return (start + torch.arange(n, dtype=torch.float32))[:, None, None].expand(n, 2, 4).contiguous()


def test_block_tables_and_gather():
    cache = make()
    assert cache.block_size == 16
    slot = cache.alloc_slot()
    cache.ensure(slot, 40)
    assert len(cache.block_table(slot)) == 3
    cache.write(1, slot, 0, kv(40, 0.0), -kv(40, 0.0))
    k, v = cache.gather(1, slot)
    assert torch.equal(k, kv(40, 0.0)) and torch.equal(v, -kv(40, 0.0))
    tables = cache.block_tables([slot])
    assert tables.shape == (1, 3) and tables.dtype == torch.int32
    stats = cache.stats()
    assert stats.mapped_bytes == 3 * 16 * SPEC.bytes_per_token
    assert stats.used_bytes == 40 * SPEC.bytes_per_token


def test_fork_shares_blocks_and_copies_on_write():
    cache = make()
    a = cache.alloc_slot()
    cache.ensure(a, 20)
    cache.write(0, a, 0, kv(20, 0.0), -kv(20, 0.0))
    b = cache.alloc_slot()
    cache.share_prefix(a, b, 20)
    assert cache.block_table(b) == cache.block_table(a)
    cache.ensure(b, 21)  # appends into the shared partial block: it is copied
    assert cache.block_table(b)[0] == cache.block_table(a)[0]
    assert cache.block_table(b)[1] != cache.block_table(a)[1]
    cache.write(0, b, 20, kv(1, 99.0), -kv(1, 99.0))
    assert torch.equal(cache.gather(0, a)[0], kv(20, 0.0))
    assert torch.equal(cache.gather(0, b)[0][:20], kv(20, 0.0))
    check_invariants(cache)


def test_free_returns_blocks_at_once_and_exhaustion_is_clean():
    cache = make(blocks=4)
    a = cache.alloc_slot()
    cache.ensure(a, 48)
    b = cache.alloc_slot()
    before = cache.stats()
    with pytest.raises(KVCacheExhausted, match="needs 2 physical pages, 1 free"):
        cache.ensure(b, 32)
    assert cache.stats() == before
    cache.free_slot(a)
    assert cache.stats().free_pages == 4 and cache.stats().mapped_bytes == 0
    cache.ensure(b, 64)
    check_invariants(cache)


def test_bad_spec_and_pool():
    with pytest.raises(ValueError, match="needs layout 'paged'"):
        PagedKVCache(KVCacheSpec(2, 2, 4), 1 << 20)
    with pytest.raises(ValueError, match="holds no block"):
        PagedKVCache(SPEC, 10)


def test_paged_cache_maps_exactly_what_the_spec_accounts():
    cache = make(blocks=16)
    lengths = [1, 16, 17, 50]
    for n in lengths:
        cache.ensure(cache.alloc_slot(), n)
    assert cache.stats().mapped_bytes == sum(SPEC.physical_bytes_for(n) for n in lengths)


def test_paged_rows_follow_the_block_table():
    cache = make()
    cache.alloc_slot()
    slot = cache.alloc_slot()
    cache.ensure(slot, 40)
    cache.write(0, slot, 0, kv(40, 0.0), -kv(40, 0.0))
    k_rows, v_rows = cache.rows(0)
    index = cache.token_rows(slot, 10, 40)
    assert torch.equal(k_rows[index], kv(30, 10.0))
    assert torch.equal(v_rows[index], -kv(30, 10.0))


def test_close_gives_the_block_pools_back_while_the_object_lives():
    cache = make()
    slot = cache.alloc_slot()
    cache.ensure(slot, 40)
    pools = [weakref.ref(cache._k), weakref.ref(cache._v)]
    cache.close()
    assert all(pool() is None for pool in pools)  # freed now, though the cache object lives on
    stats = cache.stats()
    assert (stats.pool_bytes, stats.mapped_bytes, stats.slots_in_use) == (0, 0, 0)
    cache.close()  # twice is fine
