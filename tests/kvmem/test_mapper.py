"""AsyncMapper: background mapping, stall accounting, errors surfacing in the caller, clean shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from kvmem import AsyncMapper, KVCacheError, KVCacheExhausted, MappingPlan
from tests.conftest import check_invariants, tokens_per_page


def test_plan_is_mapped_in_the_background(cache_factory):
    cache = cache_factory()
    tpp = tokens_per_page(cache)
    slots = [cache.alloc_slot() for _ in range(3)]
    with AsyncMapper(cache) as mapper:
        plan = mapper.submit(MappingPlan({s: (i + 1) * tpp for i, s in enumerate(slots)}))
        plan._done.wait(timeout=30)  # the thread alone finishes it
        assert plan.done
        mapper.wait(plan)
    assert [cache.num_tokens(s) for s in slots] == [tpp, 2 * tpp, 3 * tpp]
    assert cache.stats().stall_seconds == 0.0  # nothing was waited for
    check_invariants(cache)


def test_drain_returns_once_the_thread_has_run_everything_queued_before_it(cache_factory):
    cache = cache_factory()
    tpp = tokens_per_page(cache)
    slots = [cache.alloc_slot() for _ in range(2)]
    mapper = AsyncMapper(cache)
    with cache._lock:  # the thread blocks in the first plan: drain must wait for it and the one after
        first = mapper.submit(MappingPlan({slots[0]: 2 * tpp}))
        second = mapper.submit(MappingPlan({slots[1]: tpp}))
        drained = threading.Thread(target=mapper.drain)
        drained.start()
        time.sleep(0.05)
        assert drained.is_alive() and not first.done
    drained.join(timeout=30)
    assert not drained.is_alive() and first.done and second.done
    assert [cache.num_tokens(s) for s in slots] == [2 * tpp, tpp]
    assert cache.stats().stall_seconds == 0.0  # no plan was waited for
    mapper.close()
    with pytest.raises(KVCacheError, match="AsyncMapper is closed"):
        mapper.drain()


def test_wait_runs_what_the_thread_has_not_started_and_counts_the_stall(cache_factory):
    cache = cache_factory()
    tpp = tokens_per_page(cache)
    slot = cache.alloc_slot()
    mapper = AsyncMapper(cache)
    with cache._lock:  # hold the cache: the thread cannot finish, so wait() must stall
        plan = mapper.submit(MappingPlan({slot: 2 * tpp}))
        time.sleep(0.05)
    mapper.wait(plan)
    assert cache.num_tokens(slot) == 2 * tpp
    assert cache.stats().stall_seconds > 0.0
    mapper.close()


def test_a_plans_ensures_run_one_at_a_time_in_its_order_whoever_runs_them(cache_factory):
    """An ensure may reclaim pages, and a worker must reclaim what its scheduler's ledger did, in the ledger's order:
    a ``wait`` that joins the mapper thread takes the next item only once the one before it is done."""
    cache = cache_factory()
    tpp = tokens_per_page(cache)
    slots = [cache.alloc_slot() for _ in range(3)]
    mapper = AsyncMapper(cache)
    with cache._lock:  # the thread takes item 0 and blocks in it
        plan = mapper.submit(MappingPlan({s: tpp for s in slots}))
        while plan._next == 0:
            time.sleep(0.001)
        waiter = threading.Thread(target=mapper.wait, args=(plan,))
        waiter.start()
        time.sleep(0.05)
        assert plan._next == 1, "wait() started item 1 while item 0 was still running"
    waiter.join()
    assert [cache.num_tokens(s) for s in slots] == [tpp] * 3
    mapper.close()
    check_invariants(cache)


def test_error_in_plan_surfaces_in_wait(cache_factory):
    cache = cache_factory(pool_groups=2)
    tpp = tokens_per_page(cache)
    slot = cache.alloc_slot()
    with AsyncMapper(cache) as mapper:
        plan = mapper.submit(MappingPlan({slot: 3 * tpp}))
        with pytest.raises(KVCacheExhausted, match="needs"):
            mapper.wait(plan)
        bad = mapper.submit(MappingPlan({99: 1}))
        with pytest.raises(ValueError, match="unknown slot 99"):
            mapper.wait(bad)
    assert cache.num_tokens(slot) == 0


def test_unwaited_error_is_raised_by_close(cache_factory):
    cache = cache_factory()
    mapper = AsyncMapper(cache)
    plan = mapper.submit(MappingPlan({2: 1}))  # slot 2 was never allocated
    plan._done.wait(timeout=30)
    with pytest.raises(ValueError, match="slot 2 is not in use"):
        mapper.close()
    with pytest.raises(KVCacheError, match="closed"):
        mapper.submit(MappingPlan({}))


def test_concurrent_use_with_the_cache(cache_factory):
    """Two caller threads allocate, map, free and reclaim while the mapper thread maps; accounting
    stays exact throughout."""
    cache = cache_factory(pool_groups=64, max_slots=8)
    tpp = tokens_per_page(cache)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                slot = cache.alloc_slot()
                cache.ensure(slot, 2 * tpp)
                with cache._lock:
                    check_invariants(cache)
                cache.free_slot(slot)
        except BaseException as exc:
            errors.append(exc)

    other = threading.Thread(target=churn)
    other.start()
    with AsyncMapper(cache) as mapper:
        for step in range(40):
            slot = cache.alloc_slot(tpp)
            plan = mapper.submit(MappingPlan({slot: tpp * (1 + step % 3)}, eager_tokens=tpp, eager_slots=1))
            stats = cache.stats()  # concurrent with the mapping thread
            assert stats.free_pages * cache.spec.page_size <= stats.pool_bytes
            mapper.wait(plan)
            assert cache.num_tokens(slot) == tpp * (1 + step % 3)
            cache.free_slot(slot)
            if step % 5 == 4:
                cache.reclaim(cache.spec.num_buffers * 2)
    stop.set()
    other.join()
    assert not errors
    check_invariants(cache)
    assert not any(t.name == "kvmem-mapper" for t in threading.enumerate())
