"""VirtualKVCache behaviour over real virtual memory (HostVMM; CudaVMM with -m gpu)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvmem import AsyncMapper, KVCacheError, KVCacheExhausted, KVCacheSpec, VirtualKVCache
from tests.conftest import check_invariants, make_spec, make_vmm, tokens_per_page

LAYOUTS = ["mega", "per_layer"]


def fill(cache, slot: int, start: int, stop: int, tag: float) -> None:
    """Write a distinct value per (slot tag, layer, K/V, token) through the torch views."""
    for layer in range(cache.spec.num_layers):
        values = tag + layer * 0.25 + torch.arange(start, stop, dtype=torch.float32, device=cache.device)
        cache.k(layer)[slot, start:stop] = values[:, None, None]
        cache.v(layer)[slot, start:stop] = -values[:, None, None]


def expected(cache, start: int, stop: int, tag: float, layer: int) -> torch.Tensor:
    return tag + layer * 0.25 + torch.arange(start, stop, dtype=torch.float32)


def assert_holds(cache, slot: int, start: int, stop: int, tag: float) -> None:
    for layer in range(cache.spec.num_layers):
        want = expected(cache, start, stop, tag, layer)
        k = cache.k(layer)[slot, start:stop].cpu()
        v = cache.v(layer)[slot, start:stop].cpu()
        assert torch.equal(k, want[:, None, None].expand_as(k)), f"K of layer {layer} differs"
        assert torch.equal(v, -want[:, None, None].expand_as(v)), f"V of layer {layer} differs"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_have_the_model_shape(cache_factory, layout):
    cache = cache_factory(layout)
    s = cache.spec
    for layer in range(s.num_layers):
        assert cache.k(layer).shape == (s.max_slots, s.max_tokens, s.num_kv_heads, s.head_dim)
        assert cache.v(layer).dtype == s.dtype
    with pytest.raises(ValueError, match="layer 2 outside"):
        cache.k(2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_data_reads_back_across_pages_and_after_growth(cache_factory, layout):
    cache = cache_factory(layout)
    tpp = tokens_per_page(cache)
    slot = cache.alloc_slot(tpp)
    cache.ensure(slot, tpp + tpp // 2)  # crosses a page boundary
    fill(cache, slot, 0, tpp + tpp // 2, tag=100.0)
    cache.ensure(slot, 3 * tpp + 1)  # maps two more pages under data already written
    fill(cache, slot, tpp + tpp // 2, 3 * tpp + 1, tag=100.0)
    assert_holds(cache, slot, 0, 3 * tpp + 1, tag=100.0)
    assert cache.stats().mapped_bytes == 4 * cache.spec.page_size * cache.spec.num_buffers
    check_invariants(cache)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slots_do_not_overlap(cache_factory, layout):
    cache = cache_factory(layout)
    tpp = tokens_per_page(cache)
    slots = [cache.alloc_slot() for _ in range(cache.spec.max_slots)]
    for i, slot in enumerate(slots):
        cache.ensure(slot, 2 * tpp)
        fill(cache, slot, 0, 2 * tpp, tag=1000.0 * (i + 1))
    for i, slot in enumerate(slots):
        assert_holds(cache, slot, 0, 2 * tpp, tag=1000.0 * (i + 1))


def test_unmapped_reads_see_zeros_and_reused_pages_are_real(cache_factory):
    cache = cache_factory()
    tpp = tokens_per_page(cache)
    assert torch.count_nonzero(cache.k(0)[:, :].cpu()) == 0  # nothing mapped: every read is the zero page
    slot = cache.alloc_slot()
    cache.ensure(slot, tpp)
    fill(cache, slot, 0, tpp, tag=7.0)
    assert torch.count_nonzero(cache.k(0)[slot, tpp:].cpu()) == 0  # beyond the mapped page
    cache.free_slot(slot)
    assert cache.reclaim(cache.spec.num_buffers) == cache.spec.num_buffers
    assert torch.count_nonzero(cache.k(1)[slot].cpu()) == 0  # unmapped again: zeros, no fault


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_page_is_visible_in_both_slots_and_isolated_after_cow(cache_factory, layout):
    cache = cache_factory(layout)
    tpp = tokens_per_page(cache)
    src = cache.alloc_slot()
    cache.ensure(src, tpp + tpp // 2)
    fill(cache, src, 0, tpp + tpp // 2, tag=10.0)
    dst = cache.alloc_slot()
    mapped_before = cache.stats().mapped_bytes
    cache.share_prefix(src, dst, tpp + tpp // 2)
    assert cache.stats().mapped_bytes == mapped_before  # sharing maps, it does not allocate
    assert_holds(cache, dst, 0, tpp + tpp // 2, tag=10.0)
    # A write through src into a still-shared page is seen through dst: the page is one memory.
    cache.k(0)[src, 1] = 5.0
    assert float(cache.k(0)[dst, 1, 0, 0]) == 5.0
    cache.k(0)[src, 1] = 10.0 + 1
    # dst appends into the shared partial page: copy-on-write gives it its own copy first.
    cache.ensure(dst, 2 * tpp)
    assert cache.stats().mapped_bytes == mapped_before + cache.spec.page_size * cache.spec.num_buffers
    fill(cache, dst, tpp + tpp // 2, 2 * tpp, tag=99.0)
    assert_holds(cache, dst, 0, tpp + tpp // 2, tag=10.0)  # copied content
    assert_holds(cache, src, 0, tpp + tpp // 2, tag=10.0)  # source untouched by dst's writes
    # The fully shared first page stays shared: a write to it through dst is a write to src.
    cache.k(1)[dst, 0] = -3.0
    assert float(cache.k(1)[src, 0, 0, 0]) == -3.0
    check_invariants(cache)


def test_source_write_into_shared_page_copies_too(cache_factory):
    cache = cache_factory()
    tpp = tokens_per_page(cache)
    src = cache.alloc_slot()
    cache.ensure(src, tpp // 2)
    fill(cache, src, 0, tpp // 2, tag=1.0)
    dst = cache.alloc_slot()
    cache.share_prefix(src, dst, tpp // 2)
    cache.ensure(src, tpp)  # src appends into the page dst shares
    fill(cache, src, tpp // 2, tpp, tag=50.0)
    assert_holds(cache, dst, 0, tpp // 2, tag=1.0)
    assert torch.count_nonzero(cache.k(0)[dst, tpp // 2 : tpp].cpu() - 50.0 - tpp // 2) > 0
    check_invariants(cache)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_accounting_returns_to_zero(cache_factory, layout):
    cache = cache_factory(layout)
    tpp = tokens_per_page(cache)
    pool = cache.stats().pool_bytes
    a, b = cache.alloc_slot(), cache.alloc_slot()
    cache.ensure(a, 2 * tpp + 3)
    cache.share_prefix(a, b, tpp + 1)
    cache.ensure(b, tpp + 5)
    stats = cache.stats()
    assert stats.slots_in_use == 2
    # b copied its second page (5 tokens on it); the shared first page counts once
    assert stats.used_bytes == (2 * tpp + 3 + 5) * cache.spec.bytes_per_token
    cache.free_slot(a)
    cache.free_slot(b)
    mapped = cache.stats().mapped_bytes
    assert mapped == 4 * cache.spec.num_buffers * cache.spec.page_size  # deferred: still mapped
    assert cache.reclaim(10**9) == mapped // cache.spec.page_size
    stats = cache.stats()
    assert (stats.mapped_bytes, stats.used_bytes, stats.slots_in_use) == (0, 0, 0)
    assert stats.free_pages * cache.spec.page_size == pool
    assert stats.maps == stats.unmaps
    check_invariants(cache)


def test_exhausted_raises_with_numbers_and_leaves_state_unchanged(cache_factory):
    cache = cache_factory(pool_groups=3)
    tpp = tokens_per_page(cache)
    a = cache.alloc_slot()
    cache.ensure(a, 2 * tpp)
    fill(cache, a, 0, 2 * tpp, tag=3.0)
    b = cache.alloc_slot()
    before = cache.stats()
    slots_before = [(s.in_use, s.tokens, list(s.pages)) for s in cache._slots]
    with pytest.raises(KVCacheExhausted) as info:
        cache.ensure(b, 3 * tpp)
    nb = cache.spec.num_buffers
    assert (info.value.needed_pages, info.value.free_pages) == (3 * nb, nb)
    assert f"needs {3 * nb} physical pages, {nb} free or reclaimable" in str(info.value)
    assert cache.stats() == before
    assert [(s.in_use, s.tokens, list(s.pages)) for s in cache._slots] == slots_before
    assert_holds(cache, a, 0, 2 * tpp, tag=3.0)
    cache.ensure(b, tpp)  # what fits still works


def test_ensure_reclaims_pages_of_free_slots_when_short(cache_factory):
    cache = cache_factory(pool_groups=4)
    tpp = tokens_per_page(cache)
    a = cache.alloc_slot()
    cache.ensure(a, 3 * tpp)
    cache.free_slot(a)
    b = cache.alloc_slot(0)  # best fit for 0 pages: an empty slot, not a
    assert b != a
    cache.ensure(b, 4 * tpp)  # needs a's deferred pages
    assert len(cache._slots[a].pages) == 0
    check_invariants(cache)


def test_reclaim_takes_the_free_slot_freed_longest_ago_first(cache_factory):
    """A slot freed last may still be read by the steps in flight (its unmaps wait for them); the one freed first is
    done with: its pages go first, whatever the slots' sizes, and those of a slot just freed stay mapped."""
    cache = cache_factory(pool_groups=6)
    tpp = tokens_per_page(cache)
    old, new = cache.alloc_slot(), cache.alloc_slot()
    cache.ensure(old, 2 * tpp)
    cache.ensure(new, 3 * tpp)  # the most surplus once freed: taken first, before
    cache.free_slot(old)
    cache.free_slot(new)
    grower = cache.alloc_slot(0)
    cache.ensure(grower, 3 * tpp)  # two pages more than the pool's one: the old slot's
    assert (len(cache._slots[old].pages), len(cache._slots[new].pages)) == (0, 3)
    check_invariants(cache)


def test_a_reclaim_that_walks_the_slots_frees_a_batch_not_a_page(cache_factory):
    """With the pool dry, each page a growing sequence asks for would walk every slot: the walk frees
    ``reclaim_batch`` pages (1/256 of the pool), and the next pages come from the pool without one."""
    cache = cache_factory(pool_groups=1024, max_slots=80, pages_per_slot=16)
    tpp = tokens_per_page(cache)
    assert cache.reclaim_batch() == 4
    slots = [cache.alloc_slot(16 * tpp) for _ in range(64)]
    for slot in slots:  # every page mapped into a slot, the slots freed: deferred reclamation keeps them all
        cache.ensure(slot, 16 * tpp)
    for slot in slots:
        cache.free_slot(slot)
    assert cache.free_pages() == 0
    grower = cache.alloc_slot(0)  # best fit for nothing: an empty slot
    assert cache._slots[grower].pages == []
    cache.ensure(grower, tpp)  # one page: the walk takes four from the end of one free slot
    assert cache.free_pages() == 3
    full = [len(s.pages) for s in cache._slots if s.pages and not s.in_use]
    assert sorted(full) == [12] + [16] * 63
    cache.ensure(grower, 4 * tpp)
    assert cache.free_pages() == 0
    check_invariants(cache)


class QueuedRead:
    """Work still queued on the cache's device that reads a slot: a kernel behind a long sleep on the GPU (its
    recorded event is the fence), a thread holding the slot's rows on the host until ``release``."""

    def __init__(self, cache, slot: int):
        self.cache, self.slot = cache, slot
        if cache.device.type == "cuda":
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device time before the read
            self.total = cache.k(0)[slot].sum()
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self._go, self.total = threading.Event(), None
            self._thread = threading.Thread(target=self._read)
            self._thread.start()

    def _read(self) -> None:
        self._go.wait()
        self.total = self.cache.k(0)[self.slot].sum()

    def release(self) -> None:
        if self.cache.device.type != "cuda":
            self._go.set()

    def query(self) -> bool:
        return self.event.query() if self.cache.device.type == "cuda" else not self._thread.is_alive()

    def synchronize(self) -> None:
        if self.cache.device.type == "cuda":
            self.event.synchronize()
        else:
            self._thread.join()


def freed_under_a_read(cache, pages: int) -> tuple[int, float, QueuedRead]:
    """A slot of ``pages`` full pages freed while queued work reads it: (slot, the sum the read must see, the read)."""
    tpp = tokens_per_page(cache)
    slot = cache.alloc_slot()
    cache.ensure(slot, pages * tpp)
    fill(cache, slot, 0, pages * tpp, tag=2.0)
    want = cache.k(0)[slot].sum().item()
    read = QueuedRead(cache, slot)
    cache.free_slot(slot, fence=read)
    return slot, want, read


def test_a_fenced_free_slot_is_unmapped_only_after_the_queued_read(cache_factory):
    """A slot freed while queued work still reads it (async scheduling: the step in flight has its row) is free at
    once, and reusable at once. Its pages may go to another slot at once too: their old mappings stay until that
    work is done (a page mapped at two addresses meanwhile), so the read sees the data, and the next ensure after
    it undoes them."""
    cache = cache_factory(pool_groups=4)
    tpp = tokens_per_page(cache)
    a, want, read = freed_under_a_read(cache, 3)
    assert not read.query()  # freeing waited for nothing
    b = cache.alloc_slot(0)
    assert b != a
    reclaim = threading.Thread(target=cache.ensure, args=(b, 4 * tpp))  # needs a's deferred pages
    reclaim.start()
    reclaim.join(10)
    if reclaim.is_alive():
        read.release()  # or the cache's teardown waits for it forever
    assert not reclaim.is_alive() and not read.query(), "taking a fenced slot's pages waited for the queued read"
    assert len(cache._slots[a].pages) == 0 and len(cache._slots[a].stale) == 3
    read.release()
    read.synchronize()
    assert read.total.item() == want
    cache.ensure(b, 4 * tpp)
    assert not cache._slots[a].stale and cache._slots[a].fence is None
    check_invariants(cache)


def test_pages_let_go_of_in_the_background_mode_are_unmapped_by_the_mappers_clean(cache_factory):
    """A new request reclaiming a free slot's pages (a step's launch) maps its own and unmaps nothing; the mapper's
    thread undoes the old mappings later, and the slot reads zeros then."""
    cache = cache_factory(pool_groups=4, background_unmaps=True)
    tpp = tokens_per_page(cache)
    a = cache.alloc_slot()
    cache.ensure(a, 4 * tpp)
    fill(cache, a, 0, 4 * tpp, tag=2.0)
    cache.free_slot(a)
    b = cache.alloc_slot(0)
    assert b != a
    unmaps = cache.counters()[1]
    cache.ensure(b, 4 * tpp)  # the whole pool: a's pages
    assert cache.counters()[1] == unmaps and len(cache._slots[a].stale) == 4
    fill(cache, b, 0, 4 * tpp, tag=3.0)
    assert cache.has_stale
    with AsyncMapper(cache) as mapper:
        assert mapper.clean().wait(10)
        assert not cache.has_stale
        assert mapper.clean().is_set()  # nothing stale: done at once, nothing queued
    assert cache.counters()[1] == unmaps + 4 and not cache._slots[a].stale
    assert_holds(cache, b, 0, 4 * tpp, tag=3.0)
    assert cache.k(0)[a].abs().sum().item() == 0
    check_invariants(cache)


def test_a_background_clean_leaves_a_fenced_slots_mappings_until_its_reader_is_done(cache_factory):
    cache = cache_factory(pool_groups=4, background_unmaps=True)
    tpp = tokens_per_page(cache)
    a, want, read = freed_under_a_read(cache, 3)
    b = cache.alloc_slot(0)
    cache.ensure(b, 4 * tpp)  # a's three pages and the free one; a's mappings stay
    with AsyncMapper(cache) as mapper:
        try:
            assert mapper.clean().wait(10)
            assert len(cache._slots[a].stale) == 3, "unmapped under a queued read"
        finally:
            read.release()
        read.synchronize()
        assert read.total.item() == want
        assert mapper.clean().wait(10)
    assert not cache._slots[a].stale
    check_invariants(cache)


def test_a_slot_whose_pages_were_taken_under_a_fence_waits_for_it_before_mapping_again(cache_factory):
    """Its old mappings lie where its next pages go: they are undone first, after the queued read (which still sees
    what was there)."""
    cache = cache_factory(pool_groups=5)
    tpp = tokens_per_page(cache)
    a, want, read = freed_under_a_read(cache, 4)
    b = cache.alloc_slot(0)
    cache.ensure(b, 2 * tpp)  # the free page and a's last
    assert len(cache._slots[a].stale) == 1
    cache.free_slot(b)
    assert cache.alloc_slot(4 * tpp) == a  # best fit: the free slot holding the most pages
    grow = threading.Thread(target=cache.ensure, args=(a, 4 * tpp))  # a page of b's, where a's stale one is mapped
    grow.start()
    grow.join(0.05)
    if cache.device.type != "cuda":
        assert grow.is_alive(), "mapped over a stale page before the queued read was done"
    read.release()
    grow.join()
    assert read.total.item() == want and not cache._slots[a].stale
    fill(cache, a, 0, 4 * tpp, tag=4.0)
    assert_holds(cache, a, 0, 4 * tpp, tag=4.0)
    check_invariants(cache)


def test_a_fenced_slot_is_reused_without_waiting(cache_factory):
    cache = cache_factory(pool_groups=4)
    tpp = tokens_per_page(cache)
    a = cache.alloc_slot(2 * tpp)
    cache.ensure(a, 2 * tpp)
    read = QueuedRead(cache, a)
    cache.free_slot(a, fence=read)
    assert cache.alloc_slot(2 * tpp) == a  # best fit: its pages are still mapped
    cache.ensure(a, 2 * tpp)
    fill(cache, a, 0, 2 * tpp, tag=5.0)  # work queued after the fence (the host: here, now)
    assert not read.query()
    read.release()
    read.synchronize()
    cache.free_slot(a)
    assert cache.reclaim(2 * cache.units_per_page) == 2 * cache.units_per_page
    check_invariants(cache)


def test_pages_past_a_reused_slots_expectation_are_reclaimed_and_its_data_kept(cache_factory):
    """A short request in the slot a long one left keeps its pages mapped but owns only what it can grow to: the
    rest is reclaimed when another slot needs it (after free slots' pages), never its data."""
    cache = cache_factory(pool_groups=4)
    tpp = tokens_per_page(cache)
    long = cache.alloc_slot(4 * tpp)
    cache.ensure(long, 4 * tpp)
    cache.free_slot(long)
    short = cache.alloc_slot(tpp + 1)  # may grow to 2 pages: 2 of the 4 it finds mapped are surplus
    assert short == long
    cache.ensure(short, tpp)
    fill(cache, short, 0, tpp, tag=1.0)
    other = cache.alloc_slot(2 * tpp)
    cache.ensure(other, 2 * tpp)  # the pool is empty: the surplus is taken
    assert len(cache._slots[short].pages) == 2
    with pytest.raises(KVCacheExhausted):
        cache.ensure(other, 3 * tpp)  # the short request's 2 pages are its own
    cache.ensure(short, tpp + 1)
    assert_holds(cache, short, 0, tpp, tag=1.0)
    check_invariants(cache)


def test_alloc_prefers_best_fitting_mapped_slot(cache_factory):
    cache = cache_factory(pool_groups=16)
    tpp = tokens_per_page(cache)
    slots = [cache.alloc_slot() for _ in range(3)]
    for slot, pages in zip(slots, (1, 3, 2)):
        cache.ensure(slot, pages * tpp)
    for slot in slots:
        cache.free_slot(slot)
    maps = cache.stats().maps
    assert cache.alloc_slot(2 * tpp) == slots[2]  # 2 pages fits 2 exactly
    assert cache.alloc_slot(4 * tpp) == slots[1]  # none covers 4: the most mapped
    reused = cache.alloc_slot(1)
    assert reused == slots[0]
    cache.ensure(reused, tpp)
    assert cache.stats().maps == maps  # reused pages: no mapping at all


def test_bad_input_names_the_value(cache_factory):
    cache = cache_factory()
    s = cache.spec
    with pytest.raises(ValueError, match=r"unknown slot 99"):
        cache.ensure(99, 1)
    with pytest.raises(ValueError, match=r"slot 0 is not in use"):
        cache.ensure(0, 1)
    slot = cache.alloc_slot()
    with pytest.raises(ValueError, match=rf"num_tokens={s.max_tokens + 1} outside \[0, max_tokens={s.max_tokens}\]"):
        cache.ensure(slot, s.max_tokens + 1)
    with pytest.raises(ValueError, match=r"expected_tokens=-1"):
        cache.alloc_slot(-1)
    cache.free_slot(slot)
    with pytest.raises(ValueError, match=r"slot 0 is not in use \(never allocated, or freed twice\)"):
        cache.free_slot(slot)
    slot = cache.alloc_slot()
    cache.ensure(slot, 4)
    with pytest.raises(ValueError, match=rf"write of 2 tokens at 3 into slot {slot} outside the 4 tokens"):
        cache.write(0, slot, 3, torch.zeros(2, s.num_kv_heads, s.head_dim), torch.zeros(2, s.num_kv_heads, s.head_dim))
    with pytest.raises(ValueError, match=r"share_prefix: tokens=5 outside \(0, 4\]"):
        cache.share_prefix(slot, cache.alloc_slot(), 5)
    while True:
        try:
            cache.alloc_slot()
        except KVCacheError as exc:
            assert f"all {s.max_slots} slots are in use" in str(exc)
            break


def test_write_stores_through_the_checked_path(cache_factory):
    cache = cache_factory()
    s = cache.spec
    slot = cache.alloc_slot()
    cache.ensure(slot, 6)
    k = torch.randn(6, s.num_kv_heads, s.head_dim, device=cache.device)
    cache.write(1, slot, 0, k, -k)
    assert torch.equal(cache.k(1)[slot, :6], k)
    assert torch.equal(cache.v(1)[slot, :6], -k)


def test_spec_beyond_the_virtual_space_is_rejected(backend):
    vmm = make_vmm(backend)
    huge = KVCacheSpec(80, 64, 256, torch.float32, max_slots=1 << 14, max_tokens=1 << 20, layout="per_layer", page_size=2 << 20)
    with pytest.raises(KVCacheError, match=r"does not fit the virtual address space: 160 buffers of \d+ bytes"):
        VirtualKVCache(huge, 0, vmm, zero_unmapped=False)


def test_page_size_must_match_backend_granularity(backend):
    vmm = make_vmm(backend)
    spec = make_spec(backend)
    if vmm.granularity == 4096:
        pytest.skip("every legal page size is a multiple of 4 KiB")
    small = KVCacheSpec(2, 2, 16, torch.float32, 2, 64, "mega", vmm.granularity // 2)
    with pytest.raises(ValueError, match="not a multiple of the backend granularity"):
        VirtualKVCache(small, 0, vmm)
    assert spec.page_size % vmm.granularity == 0


def test_grow_and_shrink_give_memory_back(cache_factory):
    cache = cache_factory(pool_groups=2)
    page = cache.spec.page_size
    nb = cache.spec.num_buffers
    assert cache.grow(2 * nb * page) == 2 * nb * page
    assert cache.stats().pool_bytes == 4 * nb * page
    slot = cache.alloc_slot()
    cache.ensure(slot, 3 * tokens_per_page(cache))
    # Only unmapped pages can go: one group is free.
    assert cache.shrink(4 * nb * page) == nb * page
    assert cache.stats().pool_bytes == 3 * nb * page
    assert cache.stats().free_pages == 0
    cache.free_slot(slot)
    assert cache.shrink(nb * page) == 0  # deferred pages are still mapped
    cache.reclaim(nb)
    assert cache.shrink(nb * page) == nb * page
    check_invariants(cache)


def test_eager_map_prepares_free_slots(cache_factory):
    cache = cache_factory(pool_groups=5)
    tpp = tokens_per_page(cache)
    assert cache.eager_map(2 * tpp, slots=2) == 4
    maps = cache.stats().maps
    slot = cache.alloc_slot(2 * tpp)
    cache.ensure(slot, 2 * tpp)
    assert cache.stats().maps == maps  # the request found its pages mapped
    assert cache.eager_map(2 * tpp, slots=3) == 1  # best effort: only one free group left
    check_invariants(cache)


def test_strided_mega_view_is_layer_major(cache_factory):
    cache = cache_factory("mega")
    assert cache.k(1).stride(1) == cache.spec.num_layers * cache.spec.num_kv_heads * cache.spec.head_dim
    assert cache.k(1).data_ptr() - cache.k(0).data_ptr() == cache.spec.num_kv_heads * cache.spec.head_dim * 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_maps_exactly_what_the_spec_accounts(cache_factory, layout):
    """bench/fragmentation.py computes from spec.physical_bytes_for; the cache must map just that."""
    cache = cache_factory(layout, pool_groups=16, max_slots=8)
    tpp = tokens_per_page(cache)
    lengths = [1, tpp - 1, tpp, tpp + 1, 3 * tpp + 7]
    slots = []
    for n in lengths:
        slots.append(cache.alloc_slot())
        cache.ensure(slots[-1], n)
    stats = cache.stats()
    assert stats.mapped_bytes == sum(cache.spec.physical_bytes_for(n) for n in lengths)
    assert stats.used_bytes == sum(lengths) * cache.spec.bytes_per_token


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_address_the_same_memory_as_the_views(cache_factory, layout):
    cache = cache_factory(layout)
    tpp = tokens_per_page(cache)
    slot = cache.alloc_slot()
    slot = cache.alloc_slot()  # slot 1: rows start at slot_tokens
    cache.ensure(slot, tpp + 3)
    fill(cache, slot, 0, tpp + 3, tag=5.0)
    k_rows, v_rows = cache.rows(1)
    index = cache.token_rows(slot, 2, tpp + 3).to(cache.device)
    assert torch.equal(k_rows[index], cache.k(1)[slot, 2 : tpp + 3])
    assert torch.equal(v_rows[index], cache.v(1)[slot, 2 : tpp + 3])
    assert int(index[0]) == slot * cache.spec.slot_tokens + 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_page_map_draws_used_shared_kept_and_reserved_pages(cache_factory, layout):
    cache = cache_factory(layout)
    tpp, per_slot = tokens_per_page(cache), cache.spec.pages_per_slot
    src = cache.alloc_slot()
    cache.ensure(src, 2 * tpp + 1)  # three pages, all holding tokens
    dst = cache.alloc_slot()
    cache.share_prefix(src, dst, 2 * tpp)  # dst shares src's first two
    gone = cache.alloc_slot()
    cache.ensure(gone, tpp)
    cache.free_slot(gone)  # keeps its page when the cache defers reclamation
    m = cache.page_map()
    assert m.slots[src] == "SSU".ljust(per_slot, ".") and m.slots[dst] == "SS".ljust(per_slot, ".")
    kept = "M" if cache.keeps_pages_on_free else ""
    assert m.slots[gone] == kept.ljust(per_slot, ".") and not m.in_use[gone]
    assert all(row == "." * per_slot for k, row in enumerate(m.slots) if k not in (src, dst, gone))
    assert m.count("S") == 4 and m.page_bytes == cache.spec.page_bytes
