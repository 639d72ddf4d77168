"""Prefix caching in kvmem: the chained page hashes, the index's eviction order, a cache holding pages past
their slot and mapping them into another (real HostVMM: the same physical pages at two offsets), and the ledger
evicting held pages -- least recently used, deepest first, never one a running slot holds -- when memory is short."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvmem import AsyncMapper, KVCacheError, KVCacheExhausted, MappingPlan, VirtualKVCache
from kvmem.ledger import PageLedger
from kvmem.ops import DropKept, Ensure, KeepPage, MapKept, apply_ops
from kvmem.prefix import PrefixIndex, extend_page_hashes
from kvmem.spec import KVCacheSpec
from tests.conftest import check_invariants
from tests.kvmem.test_cache import assert_holds, fill

SPEC = KVCacheSpec(2, 2, 16, torch.float32, max_slots=4, max_tokens=256, layout="mega", page_size=4096)  # 16 tokens/page


def test_a_page_hash_covers_everything_before_it_and_the_salt():
    ids = list(range(100, 140))
    hashes = extend_page_hashes([], ids, SPEC)  # 16 tokens a page
    assert len(hashes) == 2  # the 8 tokens past the second page do not fill it
    assert extend_page_hashes(hashes[:1], ids, SPEC) == hashes  # extending is hashing from the start
    changed = extend_page_hashes([], ids[:3] + [0] + ids[4:], SPEC)
    assert changed[0] != hashes[0] and changed[1] != hashes[1]  # the second page's tokens are equal, its prefix not
    salted = extend_page_hashes([], ids, SPEC, salt="tenant-a")
    assert not set(salted) & set(hashes) and salted != extend_page_hashes([], ids, SPEC, salt="tenant-b")
    longer = ids + [1] * 24
    assert extend_page_hashes(list(hashes), longer, SPEC) == extend_page_hashes([], longer, SPEC)


def test_a_token_that_runs_over_a_page_end_is_in_both_pages_hashes():
    spec = KVCacheSpec(3, 2, 128, torch.float32, max_slots=2, max_tokens=64, layout="mega", page_size=4096)
    assert spec.token_bytes == 3072  # 4/3 tokens a page
    assert [spec.page_tokens(i) for i in range(3)] == [(0, 2), (1, 3), (2, 4)]
    assert (spec.full_pages(1), spec.full_pages(2), spec.full_pages(4)) == (0, 1, 3)
    assert (spec.tokens_within(1), spec.tokens_within(2), spec.tokens_within(3)) == (1, 2, 4)
    assert len(extend_page_hashes([], [5, 6, 7], spec)) == 2
    one, two = extend_page_hashes([], [5, 6, 7], spec), extend_page_hashes([], [5, 6, 8], spec)
    assert one[0] == two[0] and one[1] != two[1]  # token 2 has bytes in page 1 only


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
def test_kept_pages_outlive_their_slot_and_map_into_another_without_a_copy(cache_factory, layout):
    cache = cache_factory(layout, pool_groups=8)
    page = cache.spec.tokens_within(1)
    a = cache.alloc_slot(3 * page)
    cache.ensure(a, 2 * page + 3)
    fill(cache, a, 0, 2 * page + 3, tag=10.0)
    with pytest.raises(ValueError, match="page 2 of slot 0 is not full: the slot holds .* which fill 2 pages"):
        cache.keep(a, 2, key=9)
    cache.keep(a, 0, key=0)
    cache.keep(a, 1, key=1)
    with pytest.raises(KVCacheError, match="key 1 already holds a page"):
        cache.keep(a, 1, key=1)
    cache.free_slot(a)
    cache.reclaim(10**6)  # the free slot lets go of its pages; the held ones stay
    assert cache.kept_pages() == 2 and cache.stats().mapped_bytes == 2 * cache.spec.page_size * cache.spec.num_buffers
    b = cache.alloc_slot(3 * page)
    cache.map_kept(b, [0, 1])
    assert cache.num_tokens(b) == 2 * page
    assert_holds(cache, b, 0, 2 * page, tag=10.0)  # the K/V slot a wrote, read through slot b's offsets
    cache.ensure(b, 2 * page + 5)  # past the held pages: fresh pages, no copy of a shared one
    fill(cache, b, 2 * page, 2 * page + 5, tag=10.0)
    assert_holds(cache, b, 0, 2 * page + 5, tag=10.0)
    with pytest.raises(ValueError, match=f"slot {b} holds {2 * page + 5} tokens already"):
        cache.map_kept(b, [0])
    with pytest.raises(KVCacheError, match=r"no page is kept under keys \[5\]"):
        cache.drop_kept([5])
    check_invariants(cache)
    cache.drop_kept([0, 1])
    cache.free_slot(b)
    cache.reclaim(10**6)
    assert cache.stats().mapped_bytes == 0 and cache.kept_pages() == 0
    check_invariants(cache)


def test_reclaim_takes_pages_a_free_slot_alone_holds_and_leaves_a_kept_prefix_mapped(cache_factory):
    """Letting go of a free slot's kept pages frees nothing: reclaim passes over them (each unmap is ~20 us on the GPU,
    and the slot may serve the same prefix again) to take pages only their slot holds, though that slot holds fewer."""
    cache = cache_factory("mega", pool_groups=6)
    page = cache.spec.tokens_within(1)
    a = cache.alloc_slot(4 * page)
    cache.ensure(a, 4 * page)
    for i in range(4):
        cache.keep(a, i, key=i)
    cache.free_slot(a)
    b = cache.alloc_slot(2 * page, slot=a + 1)
    cache.ensure(b, 2 * page)
    cache.free_slot(b)
    assert cache.free_pages() == 0
    unmaps = cache.stats().unmaps
    c = cache.alloc_slot(2 * page, slot=b + 1)
    cache.ensure(c, 2 * page)
    assert cache.stats().unmaps - unmaps == 2
    assert len(cache._slots[a].pages) == 4 and not cache._slots[b].pages
    check_invariants(cache)


def test_a_prefix_mapped_over_a_reused_slots_own_pages_takes_their_place_in_one_unmap_and_one_mapping(
        cache_factory, monkeypatch):
    """No zero page in between (on the GPU that would be twice the driver calls): per buffer, one unmap of the run of
    own pages, one mapping of the run of held pages."""
    cache = cache_factory("mega", pool_groups=8)
    page = cache.spec.tokens_within(1)
    a = cache.alloc_slot(2 * page)
    cache.ensure(a, 2 * page)
    fill(cache, a, 0, 2 * page, tag=3.0)
    cache.keep(a, 0, key=0)
    cache.keep(a, 1, key=1)
    cache.free_slot(a)
    b = cache.alloc_slot(3 * page, slot=a + 1)
    cache.ensure(b, 3 * page)
    fill(cache, b, 0, 3 * page, tag=7.0)
    cache.free_slot(b)
    free, before = cache.free_pages(), cache.stats()
    c = cache.alloc_slot(3 * page, slot=b)
    calls, depth = Counter(), [0]

    def counted(name, real):
        def call(*args):  # the calls the cache makes (not those a backend's map_run makes of its own map)
            calls.update([name] if not depth[0] else [])
            depth[0] += 1
            try:
                return real(*args)
            finally:
                depth[0] -= 1
        return call

    for name in ("map", "map_run", "map_zero", "unmap"):
        monkeypatch.setattr(cache._vmm, name, counted(name, getattr(cache._vmm, name)))
    cache.map_kept(c, [0, 1])
    after = cache.stats()
    assert dict(calls) == {"unmap": cache.spec.num_buffers, "map_run": cache.spec.num_buffers}
    assert (after.maps - before.maps, after.unmaps - before.unmaps) == (2, 2)
    assert cache._slots[c].pages[:2] == cache._slots[a].pages[:2] and cache.free_pages() == free + 2
    assert_holds(cache, c, 0, 2 * page, tag=3.0)
    check_invariants(cache)


def test_a_token_split_across_pages_is_computed_again_into_a_copy_of_the_shared_page():
    """Pages of 4/3 tokens: a request that maps two held pages holds the 2 tokens entirely in them; writing the
    third, whose first bytes are in the second page, copies that page first (the first request's stays whole)."""
    spec = KVCacheSpec(3, 2, 128, torch.float32, max_slots=2, max_tokens=64, layout="mega", page_size=4096)
    cache = VirtualKVCache(spec, 8 * spec.num_buffers * spec.page_size)
    a = cache.alloc_slot(8)
    cache.ensure(a, 3)  # tokens 0..2: page 0 and 1 full (token 2 ends exactly at 3 * 3072 = 9216 > 8192)
    fill(cache, a, 0, 3, tag=1.0)
    cache.keep(a, 0, key=0)
    cache.keep(a, 1, key=1)
    b = cache.alloc_slot(8)
    cache.map_kept(b, [0, 1])
    assert cache.num_tokens(b) == 2 and cache.accounting().shared_pages == 2
    cache.ensure(b, 3)  # token 2 again: page 1 is copied before the write
    fill(cache, b, 2, 3, tag=5.0)
    assert_holds(cache, a, 0, 3, tag=1.0)  # a's token 2 untouched
    assert_holds(cache, b, 0, 2, tag=1.0)  # token 1's bytes in page 1 came along with the copy
    assert_holds(cache, b, 2, 3, tag=5.0)
    (a0, a1, _), (b0, b1, _) = cache._slots[a].pages, cache._slots[b].pages
    assert a0 == b0 and a1 != b1 and cache._kept == {0: a0, 1: a1}
    check_invariants(cache)
    cache.close()


def _ledger(pages: int) -> PageLedger:
    return PageLedger(SPEC, pages, keeps_pages_on_free=True, caches_prefixes=True)


def _run(ledger: PageLedger, tokens: int, hashes: list[bytes]) -> int:
    """A request of ``tokens`` tokens whose full pages are ``hashes``: computed, cached, finished."""
    slot = ledger.alloc_slot(tokens)
    ledger.ensure(slot, tokens)
    ledger.cache_pages(slot, hashes, 0)
    ledger.free_slot(slot)
    return slot


def test_the_ledger_evicts_cached_pages_nothing_holds_least_recently_used_first_and_the_workers_follow():
    ledger, cache = _ledger(6), VirtualKVCache(SPEC, 6 * SPEC.num_buffers * SPEC.page_size)
    first, second = _run(ledger, 32, [b"a0", b"a1"]), _run(ledger, 32, [b"b0", b"b1"])
    hit = ledger.cached_prefix([b"a0", b"a1"])  # a is used again, in the slot holding its pages (as the scheduler does)
    ledger.map_prefix(ledger.alloc_slot(64, ledger.slot_holding(hit)), hit)
    ops = ledger.take_ops()
    assert [op for op in ops if isinstance(op, KeepPage)] == [KeepPage(first, 0, 0), KeepPage(first, 1, 1),
                                                               KeepPage(second, 0, 2), KeepPage(second, 1, 3)]
    assert MapKept(first, (0, 1)) in ops  # the free slot that holds a's pages already: nothing to map
    apply_ops(cache, ops)
    running = next(i for i, s in enumerate(ledger._slots) if s.in_use)
    # 6 pages: 4 held (a's two by the running slot too), 2 free. 3 more for the running slot: one page is
    # evicted, b's last (b was used before a, and a prefix shrinks from its end).
    ledger.ensure(running, 32 + 3 * 16)
    ops = ledger.take_ops()
    assert ops == (DropKept((3,)), Ensure(running, 80))
    assert ledger.cached_prefix([b"b0", b"b1"]) == [2] and ledger.cached_prefix([b"a0", b"a1"]) == [0, 1]
    apply_ops(cache, ops)
    assert cache.accounting() == ledger.accounting()
    # Two more pages: b's first is one, and a's are held by the running slot (never evicted): nothing is
    # evicted for a request that would not fit anyway.
    with pytest.raises(KVCacheExhausted):
        ledger.ensure(running, 32 + 5 * 16)
    assert ledger.take_ops() == () and ledger.cached_prefix([b"b0"]) == [2]
    check_invariants(cache)


def test_decoding_behind_a_full_prefix_cache_evicts_a_batch_at_a_time_and_the_workers_follow():
    """Every page held by the prefix cache and a free slot: a growing sequence's page costs an eviction (a walk over
    every slot and the index). It evicts ``eviction_batch`` pages, least recently used first, and the next pages
    come from what that freed (a reclaim of ``reclaim_batch``)."""
    spec = KVCacheSpec(2, 2, 16, torch.float32, max_slots=80, max_tokens=256, layout="mega", page_size=4096)
    ledger = PageLedger(spec, 1024, keeps_pages_on_free=True, caches_prefixes=True)
    cache = VirtualKVCache(spec, 1024 * spec.num_buffers * spec.page_size)
    assert (ledger.reclaim_batch(), ledger.eviction_batch()) == (4, 16)
    for r in range(64):  # 64 requests of 16 full pages each, every page cached
        _run(ledger, 256, [f"{r}.{p}".encode() for p in range(16)])
    assert ledger.free_pages() == 0 and ledger.kept_pages() == 1024
    apply_ops(cache, ledger.take_ops())
    slot = ledger.alloc_slot(64)
    assert ledger._slots[slot].pages == []  # no slot's own pages cover it: an empty slot
    apply_ops(cache, ledger.take_ops())
    ledger.ensure(slot, 16)
    ops = ledger.take_ops()
    # The 16 least recently used pages, the first request's (a prefix shrinks from its end); four of them unmapped.
    assert ops == (DropKept(tuple(range(15, -1, -1))), Ensure(slot, 16))
    assert ledger.free_pages() == 3
    for tokens in (32, 48, 64):  # the next three pages: no eviction
        ledger.ensure(slot, tokens)
    ops += ledger.take_ops()
    assert ops[2:] == (Ensure(slot, 32), Ensure(slot, 48), Ensure(slot, 64)) and ledger.free_pages() == 0
    apply_ops(cache, ops)
    assert cache.accounting() == ledger.accounting()
    check_invariants(cache)
    cache.close()


def test_growth_mapped_ahead_behind_a_full_prefix_cache_evicts_first_and_the_workers_drop_before_they_map():
    """The lookahead's ``ensure_ahead`` evicts as ``ensure`` does, recorded: behind a full prefix cache a growing
    sequence's next page can be mapped ahead of its step (before, it was refused after a walk of every slot, and the
    step mapped it in its own launch). A worker that applies the step's operations, then runs the plan, agrees."""
    spec = KVCacheSpec(2, 2, 16, torch.float32, max_slots=80, max_tokens=256, layout="mega", page_size=4096)
    ledger = PageLedger(spec, 1024, keeps_pages_on_free=True, caches_prefixes=True)
    cache = VirtualKVCache(spec, 1024 * spec.num_buffers * spec.page_size)
    for r in range(64):  # every page cached, none free
        _run(ledger, 256, [f"{r}.{p}".encode() for p in range(16)])
    slot = ledger.alloc_slot(64)
    assert ledger.free_pages() == 0 and ledger._slots[slot].pages == []
    apply_ops(cache, ledger.take_ops())
    assert ledger.ensure_ahead({slot: 32}) == {slot: 32}
    ops = ledger.take_ops()
    assert ops == (DropKept(tuple(range(15, -1, -1))),)  # the least recently used batch; the plan itself is unrecorded
    apply_ops(cache, ops)
    cache.ensure(slot, 32)  # the mapper's plan
    assert cache.accounting() == ledger.accounting()
    check_invariants(cache)
    cache.close()


def test_a_request_in_a_slot_of_cached_pages_lets_them_go_at_once_and_grows_ahead_of_its_steps():
    """Cached pages a reused slot still maps hold none of the new request's tokens: its first ensure lets go of
    them all (one unmap run), so its growth maps fresh pages -- which the scheduler can do ahead of a step -- where
    copy-on-write would replace them one by one inside the steps."""
    ledger, cache = _ledger(16), VirtualKVCache(SPEC, 16 * SPEC.num_buffers * SPEC.page_size)
    cached = _run(ledger, 64, [b"a0", b"a1", b"a2", b"a3"])  # four full pages, each held by the slot and the cache
    slot = ledger.alloc_slot(64, cached)  # as a worker replays it
    ledger.ensure(slot, 16)
    assert ledger._slots[slot].pages == [4]  # a fresh page; a0..a3 stay with the prefix cache only
    assert ledger.kept_pages() == 4 and ledger.cached_prefix([b"a0", b"a1"]) == [0, 1]
    assert ledger.ensure_ahead({slot: 64}) == {slot: 64}  # nothing shared in the way: growth may be mapped ahead
    apply_ops(cache, ledger.take_ops())
    cache.ensure(slot, 64)
    assert cache.accounting() == ledger.accounting()
    check_invariants(cache)
    cache.close()


def test_a_new_request_takes_a_slot_it_writes_in_place_not_one_over_cached_pages():
    """A free slot whose pages the prefix cache holds would see each replaced by a fresh page (unmapped after the
    step that may still read it): a request without a hit takes a slot whose own pages cover it, else an empty
    one -- the one freed longest ago -- before such a slot."""
    ledger = _ledger(16)  # SPEC: 4 slots
    cached = _run(ledger, 32, [b"a0", b"a1"])  # two pages, both held by the prefix cache too
    owned = ledger.alloc_slot(32)
    ledger.ensure(owned, 32)
    ledger.free_slot(owned)  # two pages it alone holds (nothing cached)
    assert owned != cached
    fits = ledger.alloc_slot(20)
    assert fits == owned  # its own pages cover the request: written over in place
    empties = [i for i in range(SPEC.max_slots) if i not in (cached, owned)]
    emptied = ledger.alloc_slot(40)
    assert emptied == empties[0]  # no own pages anywhere: an empty slot, not the cached one
    ledger.free_slot(emptied)
    assert ledger.alloc_slot(40) == empties[1]  # of the empty ones, the one freed longest ago (never)
    assert ledger.alloc_slot(40) == emptied
    assert ledger.alloc_slot(40) == cached  # the last free slot


def test_a_reset_drops_every_held_page_and_the_pool_comes_back():
    ledger, cache = _ledger(8), VirtualKVCache(SPEC, 8 * SPEC.num_buffers * SPEC.page_size)
    _run(ledger, 40, [b"a0", b"a1"])
    _run(ledger, 20, [b"b0"])
    assert ledger.reset_prefixes() == 3 and ledger.reset_prefixes() == 0
    apply_ops(cache, ledger.take_ops())
    assert cache.accounting() == ledger.accounting() and cache.kept_pages() == 0
    cache.reclaim(10**6)
    assert cache.stats().mapped_bytes == 0


def test_free_slots_prepared_behind_a_full_prefix_cache_take_the_next_prompt_with_no_map_and_the_workers_follow():
    """Serving behind a full prefix cache: a new request was given a slot of cached pages, let go of them and mapped
    fresh ones in its step. ``eager_ahead`` prepares free slots instead, from cached pages no slot holds (dropped on
    the workers with the plan), their mapper replaying it after the step's ensures; the next request is then given a
    prepared slot and its ensure maps nothing."""
    spec = KVCacheSpec(2, 2, 16, torch.float32, max_slots=64, max_tokens=256, layout="mega", page_size=4096)
    ledger = PageLedger(spec, 1028, keeps_pages_on_free=True, caches_prefixes=True)
    cache = VirtualKVCache(spec, 1028 * spec.num_buffers * spec.page_size)
    for r in range(64):  # every slot's 16 pages cached, 4 free
        _run(ledger, 256, [f"{r}.{p}".encode() for p in range(16)])
    slot = ledger.alloc_slot(64)  # the slot freed longest ago: the first request's
    ledger.ensure(slot, 64)  # lets go of its cached pages (they stay cached, in no slot) and maps the pool's four
    apply_ops(cache, ledger.take_ops())
    assert ledger.free_pages() == 0 and cache.accounting() == ledger.accounting()

    plan = ledger.eager_ahead(64, slots=2)
    # Four pages for the slot freed longest ago now (a slot's worth a call), and one left in the pool for the slot in
    # use to grow into: the five least recently used cached pages that no slot holds, the first request's last ones,
    # dropped by the plan.
    assert (plan.needs, plan.eager_tokens, plan.eager_slots, plan.eager_pages) == ({}, 64, 2, 4)
    assert plan.eager_drop == (15, 14, 13, 12, 11) and ledger.free_pages() == 1
    assert not ledger.take_ops()  # the plan carries it all
    with AsyncMapper(cache) as mapper:
        mapper.wait(mapper.submit(plan))
    assert cache.accounting() == ledger.accounting()

    maps = ledger.counters()[0], cache.counters()[0]
    new = ledger.alloc_slot(64)
    ledger.ensure(new, 64)
    assert ledger._slots[new].pages and ledger.counters()[0] == maps[0]  # a prepared slot: nothing mapped
    apply_ops(cache, ledger.take_ops())
    assert cache.counters()[0] == maps[1] and cache.accounting() == ledger.accounting()
    check_invariants(cache)
    cache.close()


def test_preparing_free_slots_leaves_a_page_for_each_slot_in_use_and_holds_an_eighth_of_the_pool_at_most():
    ledger = PageLedger(SPEC, 64, keeps_pages_on_free=True, caches_prefixes=True)
    growing = [ledger.alloc_slot(64) for _ in range(2)]
    for slot in growing:
        ledger.ensure(slot, 16)  # one page each of the four they expect
    plan = ledger.eager_ahead(256, slots=2)  # 16 pages a slot, the pool's eighth is 8
    assert plan.eager_pages == 8 and ledger.free_pages() == 64 - 2 - 8
    assert ledger.eager_ahead(256, slots=2) is None  # the eighth is held
    full = PageLedger(SPEC, 10, keeps_pages_on_free=True, caches_prefixes=True)
    for _ in range(2):
        full.ensure(full.alloc_slot(256), 64)  # 8 pages in use, 2 free: both kept for the slots' growth
    assert full.eager_ahead(16, slots=1) is None


def test_a_waiting_requests_cached_prefix_is_mapped_ahead_into_a_free_slot_and_its_admission_maps_nothing():
    """Two requests wait on one cached prefix of four pages: the first will be given the slot that computed it, the
    second a free slot into which the mappers map the prefix beside a step (three pages: the budget), which no eager
    preparation touches; admitted, it maps the fourth only, and reads the first request's K/V. A call that no longer
    names a slot lets it go (its pages stay); with none kept and none waiting, a call has nothing to do."""
    spec = KVCacheSpec(2, 2, 16, torch.float32, max_slots=8, max_tokens=256, layout="mega", page_size=4096)
    ledger = PageLedger(spec, 64, keeps_pages_on_free=True, caches_prefixes=True)
    cache = VirtualKVCache(spec, 64 * spec.num_buffers * spec.page_size)
    hashes = [b"p0", b"p1", b"p2", b"p3"]
    first = ledger.alloc_slot(64)
    ledger.ensure(first, 64)
    apply_ops(cache, ledger.take_ops())
    fill(cache, first, 0, 64, tag=3.0)
    ledger.cache_pages(first, hashes, 0)
    ledger.free_slot(first)
    apply_ops(cache, ledger.take_ops())
    hit = ledger.cached_prefix(hashes)

    prefixes = ledger.prefix_ahead([hit, hit], pages=3)
    other = prefixes[1][0]
    assert prefixes == ((first, tuple(hit)), (other, tuple(hit[:3]))) and other != first
    assert not ledger.take_ops()  # the plan carries it
    with AsyncMapper(cache) as mapper:
        mapper.wait(mapper.submit(MappingPlan({}, prefixes=prefixes)))
    assert cache.accounting() == ledger.accounting()
    assert cache._slots[other].pages == cache._slots[first].pages[:3]  # the same pages at the other slot's offsets
    plan = ledger.eager_ahead(64, slots=8)  # free slots prepared for new prompts: not these two
    with AsyncMapper(cache) as mapper:
        mapper.wait(mapper.submit(plan))
    assert ledger._slots[other].pages == ledger._slots[first].pages[:3] and cache.accounting() == ledger.accounting()
    kept = ledger.prefix_ahead([hit], pages=0)  # one waiting now: the slot that holds it all, nothing to map
    assert kept == ((first, tuple(hit)),) and ledger._premapped == {first}
    with AsyncMapper(cache) as mapper:
        mapper.wait(mapper.submit(MappingPlan({}, prefixes=kept)))
    assert cache._premapped == {first} and cache.accounting() == ledger.accounting()

    maps = ledger.counters()[0], cache.counters()[0]
    for slot in (first, other):
        taken = ledger.alloc_slot(80, ledger.slot_holding(hit))
        assert taken == slot
        ledger.map_prefix(taken, hit)
        ledger.ensure(taken, 80)
    assert ledger.counters()[0] - maps[0] == 1 + 2  # the fourth page of the second; one page each past the prefix
    apply_ops(cache, ledger.take_ops())
    assert cache.counters()[0] - maps[1] == 3 and cache.accounting() == ledger.accounting()
    assert_holds(cache, other, 0, 64, tag=3.0)
    for slot in (first, other):
        ledger.free_slot(slot)
    assert ledger.prefix_ahead([], pages=16) is None
    apply_ops(cache, ledger.take_ops())
    check_invariants(cache)
    cache.close()


def test_prefixes_mapped_ahead_are_refused_unless_their_slots_are_free_and_their_pages_held(cache_factory):
    cache = cache_factory("mega", pool_groups=8)
    page = cache.spec.tokens_within(1)
    slot = cache.alloc_slot(page)
    cache.ensure(slot, page)
    cache.keep(slot, 0, key=0)
    with pytest.raises(ValueError, match=f"map_prefixes_ahead: slot {slot} is not a free slot of 0..{cache.spec.max_slots - 1}"):
        cache.map_prefixes_ahead(((slot, (0,)),))
    with pytest.raises(KVCacheError, match=r"map_prefixes_ahead: no page is kept under keys \[7\]"):
        cache.map_prefixes_ahead(((slot + 1, (0, 7)),))
    assert cache._slots[slot + 1].pages == []  # refused before anything was mapped
