"""A worker's cache replaying its ledger agrees with it after every step of a random serving loop.

The worker's order is fixed: the step's recorded operations first (evictions for the pages mapped ahead among them),
then the plan's ensures, then its free slots prepared (``eager_map``), then waiting requests' cached prefixes mapped
into free slots (``map_prefixes_ahead``; the next arrival, when it finds one, is given that slot). The ledger decides in another order -- it
evicts while it backs, and prepares after -- so every decision has to come out the same either way: prefix caching
on and off, free slots prepared or not, pools from short (requests fail to be backed and are dropped, as preemption
does) to roomy. A real host-VMM cache (mmap + memfd) is the worker's."""

from __future__ import annotations

import random

import pytest
import torch

from kvmem import KVCacheExhausted, VirtualKVCache
from kvmem.ledger import PageLedger
from kvmem.ops import apply_ops
from kvmem.spec import KVCacheSpec
from tests.conftest import check_invariants

SPEC = KVCacheSpec(2, 2, 16, torch.float32, max_slots=8, max_tokens=256, layout="mega", page_size=4096)  # 16 tokens/page
PREFIXES = [[f"p{j}.{k}".encode() for k in range(16)] for j in range(4)]  # page hashes of four shared prefixes


def serve(seed: int, pages: int, caching: bool, eager: bool, steps: int = 150) -> None:
    rng = random.Random(seed)
    ledger = PageLedger(SPEC, pages, keeps_pages_on_free=True, caches_prefixes=caching)
    cache = VirtualKVCache(SPEC, pages * SPEC.num_buffers * SPEC.page_size)
    running: dict[int, list] = {}  # slot -> [tokens, the most it grows to, its prefix's page hashes]
    waiting = [(rng.choice(PREFIXES), rng.randrange(1, 200)) for _ in range(2)]  # the next arrivals, known ahead

    def drop(slot: int) -> None:
        tokens, _, hashes = running.pop(slot)
        if caching:
            ledger.cache_pages(slot, hashes[: SPEC.full_pages(tokens)], 0)
        ledger.free_slot(slot)

    try:
        for step in range(steps):
            for slot in [s for s in running if rng.random() < 0.15]:  # requests end
                drop(slot)
            if rng.random() < 0.5 and len(running) < SPEC.max_slots:  # one arrives
                hashes, prompt = waiting.pop(0)
                waiting.append((rng.choice(PREFIXES), rng.randrange(1, 200)))
                hit = ledger.cached_prefix(hashes[: SPEC.full_pages(prompt)]) if caching else []
                slot = ledger.alloc_slot(min(256, prompt + rng.randrange(1, 60)), ledger.slot_holding(hit) if hit else None)
                if hit:
                    ledger.map_prefix(slot, hit)
                running[slot] = [ledger.num_tokens(slot), min(256, prompt + rng.randrange(1, 60)), hashes]
                try:
                    ledger.ensure(slot, prompt)
                    running[slot][0] = prompt
                except KVCacheExhausted:
                    drop(slot)
            for slot in list(running):  # the step's growth, in it
                tokens, most, _ = running[slot]
                try:
                    ledger.ensure(slot, min(most, tokens + rng.choice([1, 1, 1, 20])))
                    running[slot][0] = ledger.num_tokens(slot)
                except KVCacheExhausted:
                    drop(slot)
            # the lookahead: the next step's pages, then free slots prepared
            backed = ledger.ensure_ahead({slot: min(256, tokens + rng.choice([1, 1, 17, 40]))
                                          for slot, (tokens, _, _) in running.items()})
            for slot, tokens in backed.items():
                running[slot][0] = tokens
            plan = ledger.eager_ahead(rng.choice([40, 100, 200]), 3) if eager else None
            hits = [ledger.cached_prefix(h[: SPEC.full_pages(p)]) for h, p in waiting] if caching else []
            prefixes = ledger.prefix_ahead([h for h in hits if h], rng.choice([0, 2, 16])) if caching else None
            apply_ops(cache, ledger.take_ops())
            for slot, tokens in backed.items():
                cache.ensure(slot, tokens)
            if plan is not None:
                cache.eager_map(plan.eager_tokens, plan.eager_slots, plan.eager_pages, plan.eager_drop)
            if prefixes is not None:
                cache.map_prefixes_ahead(prefixes)
            assert cache.accounting() == ledger.accounting(), f"step {step}"
        check_invariants(cache)
    finally:
        cache.close()


@pytest.mark.parametrize("caching,eager", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("pages", [24, 40, 64])
def test_a_worker_replaying_its_ledger_agrees_after_every_step(pages, caching, eager):
    for seed in range(6):
        serve(seed, pages, caching, eager)


def test_a_failed_backing_leaves_the_expectation_as_it_was():
    """A ledger's ensure that raises is never replayed: it must leave nothing behind, the slot's expectation included
    (a raised one kept pages from the ledger's reclaims that the workers' reclaims take)."""
    ledger = PageLedger(SPEC, 4, keeps_pages_on_free=True)
    slot = ledger.alloc_slot(16)
    ledger.ensure(slot, 16)
    with pytest.raises(KVCacheExhausted):
        ledger.ensure(slot, 256)
    assert ledger._slots[slot].expected == 16 and ledger.ensure_ahead({slot: 256}) == {}
    assert ledger._slots[slot].expected == 16
