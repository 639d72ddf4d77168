"""Fused prefix runs (``SlotCache.fuse_prefix``), over real host virtual memory: a cached prefix copied into one
allocation that later slots map whole, the run kept whole in every slot and in the prefix cache, and the pool back
to separate pages once nothing holds it."""

from __future__ import annotations

import pytest

from kvmem import KVCacheError
from kvmem.ledger import PageLedger
from kvmem.ops import FusePrefix, apply_ops
from tests.conftest import check_invariants
from tests.kvmem.test_cache import assert_holds, fill


def _fused(cache, tokens: int) -> tuple[int, int]:
    """Slot a holding ``tokens`` tokens (written: tag 10), its first three pages kept under keys 0-2 and fused into a
    new slot b; (a, b)."""
    page = cache.spec.tokens_within(1)
    a = cache.alloc_slot(4 * page)
    cache.ensure(a, tokens)
    fill(cache, a, 0, tokens, tag=10.0)
    for i in range(3):
        cache.keep(a, i, key=i)
    b = cache.alloc_slot(4 * page)
    cache.fuse_prefix(a, b, [0, 1, 2])
    return a, b


def _mappings_at(cache, slot: int) -> list[int]:
    """The sizes of the host mappings that start at ``slot``'s first page, one per buffer."""
    return [cache._vmm._mapped.get(base + cache._offset(slot, 0)) for base in cache._bases]


@pytest.mark.parametrize("layout", ["mega", "per_layer"])
def test_a_fused_prefix_holds_the_bytes_it_was_copied_from_and_maps_as_one_allocation(backend, layout):
    from kvmem import VirtualKVCache
    from tests.conftest import make_spec, make_vmm

    spec = make_spec(backend, layout, max_slots=6)
    cache = VirtualKVCache(spec, 12 * spec.num_buffers * spec.page_size, make_vmm(backend), zero_unmapped=False)
    page, size = cache.spec.tokens_within(1), cache.spec.page_size
    one_mapping = (lambda slot: _mappings_at(cache, slot) == [3 * size] * spec.num_buffers) if backend == "host" \
        else (lambda slot: len(cache._pool._fused) == spec.num_buffers)  # the driver keeps no list: one allocation
    a, b = _fused(cache, 3 * page + 2)
    assert cache.num_tokens(b) == 3 * page
    assert_holds(cache, b, 0, 3 * page, tag=10.0)  # a's bytes, copied
    assert one_mapping(b)  # one allocation a buffer, mapped whole
    c = cache.alloc_slot(4 * page)
    cache.map_kept(c, [0, 1, 2])  # the cache holds the fused run under the keys now
    assert_holds(cache, c, 0, 3 * page, tag=10.0)
    assert one_mapping(c)
    fill(cache, c, 0, page, tag=50.0)  # one allocation behind both: what c writes there b reads
    assert_holds(cache, b, 0, page, tag=50.0)
    assert_holds(cache, a, 0, page, tag=10.0)  # a keeps the pages the run was copied from
    assert cache.whole_runs([0, 1]) == [] and cache.whole_runs([0, 1, 2]) == [0, 1, 2]
    with pytest.raises(KVCacheError, match="end inside a fused run"):
        cache.map_kept(cache.alloc_slot(4 * page), [0, 1])
    with pytest.raises(KVCacheError, match="does not hold the 3 unfused pages"):
        cache.fuse_prefix(b, cache.alloc_slot(4 * page), [0, 1, 2])  # fused already
    check_invariants(cache)
    cache.ensure(c, 3 * page + 5)  # grows past the run: a page of its own
    cache.drop_kept([0, 1, 2])
    for slot in range(cache.spec.max_slots):
        if cache._slots[slot].in_use:
            cache.free_slot(slot)
    cache.reclaim(10**6)
    check_invariants(cache)
    assert cache.stats().mapped_bytes == 0 and cache._pool.num_free == cache._pool.num_pages
    assert not cache._pool._fused and not cache._runs  # separate pages again
    cache.close()
    cache._vmm.close()


def test_a_slot_lets_go_of_a_fused_run_whole_and_never_of_part_under_its_tokens(cache_factory):
    cache = cache_factory("mega", pool_groups=12, zero_unmapped=False)
    page = cache.spec.tokens_within(1)
    a, b = _fused(cache, 3 * page + 1)
    with pytest.raises(KVCacheError, match="would take a fused run that holds its tokens"):
        cache._drop_tail(b, 1)
    cache.free_slot(b)
    cache._drop_tail(b, 2)  # a free slot: from the run's start
    assert cache._slots[b].pages == []
    check_invariants(cache)
    d = cache.alloc_slot(4 * page)
    cache.map_kept(d, [0, 1, 2])
    cache.free_slot(d)
    e = cache.alloc_slot(4 * page, slot=d)
    cache.ensure(e, page)  # a new request over the slot: its first write would land in the run
    assert cache._slots[e].pages[0] not in cache._runs  # the run went whole, a page of its own came
    check_invariants(cache)


def test_a_ledger_records_the_fusing_and_a_cache_replaying_it_agrees():
    """The ledger's decision (a slot holding the prefix, another about to map it) travels as one operation; the
    replaying cache holds the same pages, free counts and held keys, and an eviction drops a run's keys all at once."""
    from kvmem import VirtualKVCache
    from tests.conftest import make_spec, make_vmm

    spec = make_spec("host", "mega")
    cache = VirtualKVCache(spec, 10 * spec.num_buffers * spec.page_size, make_vmm("host"), zero_unmapped=False)
    ledger = PageLedger(spec, 10, keeps_pages_on_free=True, caches_prefixes=True)
    page = spec.tokens_within(1)
    a = ledger.alloc_slot(4 * page)
    ledger.ensure(a, 3 * page + 1)
    keys = ledger.cache_pages(a, [bytes([i]) for i in range(3)], 0)
    b = ledger.alloc_slot(4 * page)
    assert ledger.fusable(keys, b, least=4) is None  # shorter than asked
    assert ledger.fusable(keys, b, least=2) == a
    ledger.fuse_prefix(a, b, keys)
    ops = ledger.take_ops()
    assert FusePrefix(a, b, tuple(keys)) in ops and ledger.prefix_runs_fused == 1
    apply_ops(cache, ops)
    assert ledger.accounting() == cache.accounting()
    assert ledger.fusable(keys, ledger.alloc_slot(4 * page), least=2) is None  # one allocation already
    ledger._evict((keys[-1],))  # an eviction that names one of a run's keys drops them all
    apply_ops(cache, ledger.take_ops())
    assert ledger.kept_pages() == cache.kept_pages() == 0 and ledger.accounting() == cache.accounting()
    check_invariants(cache)
    cache.close()
    cache._vmm.close()


def test_room_for_a_fused_run_comes_from_other_free_slots_never_from_the_one_it_is_copied_from(cache_factory):
    """A full pool: the run's pages are reclaimed from a free slot's own pages, while the free slot holding the prefix
    (the copy's source, its pages past the prefix its own too) keeps them until the copy has read them."""
    cache = cache_factory("mega", pool_groups=10, zero_unmapped=False)
    page = cache.spec.tokens_within(1)
    a = cache.alloc_slot(4 * page)
    cache.ensure(a, 4 * page)
    fill(cache, a, 0, 4 * page, tag=10.0)
    for i in range(3):
        cache.keep(a, i, key=i)
    x = cache.alloc_slot(4 * page)
    cache.ensure(x, 4 * page)
    cache.free_slot(a)
    cache.free_slot(x)
    y = cache.alloc_slot(4 * page, slot=2)
    cache.ensure(y, 2 * page)  # the pool is empty now: 4 + 4 + 2 of 10 pages
    assert cache._free_pages() == 0
    b = cache.alloc_slot(4 * page, slot=3)
    cache.fuse_prefix(a, b, [0, 1, 2])
    assert_holds(cache, b, 0, 3 * page, tag=10.0)
    assert len(cache._slots[a].pages) == 4 and len(cache._slots[x].pages) == 1  # x gave its own three
    check_invariants(cache)


def test_the_slot_a_run_was_copied_from_takes_the_run_and_its_own_pages_go_back(cache_factory):
    cache = cache_factory("mega", pool_groups=12, zero_unmapped=False)
    page = cache.spec.tokens_within(1)
    a, b = _fused(cache, 3 * page + 2)
    free = cache._free_pages()
    assert not cache.adopt_run(b, [0, 1, 2])  # b holds the run already
    assert cache.adopt_run(a, [0, 1, 2])
    assert cache._free_pages() == free + 3  # the pages the run was copied from: one copy of the prefix is held
    assert cache._slots[a].pages[:3] == list(cache._runs[cache._slots[b].pages[0]])
    assert_holds(cache, a, 0, 3 * page + 2, tag=10.0)  # its tokens, the run's bytes, and its own page past them
    with pytest.raises(KVCacheError, match="do not hold a fused run"):
        cache.adopt_run(a, [0, 1])
    check_invariants(cache)
