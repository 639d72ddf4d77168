"""Random alloc/ensure/share/free/reclaim/grow/shrink sequences against a simple model of slot contents.

After every step: the invariants hold (every used token backed, no page owned twice unless shared,
free + mapped = pool) and every live slot reads back exactly what the model says it holds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvmem import KVCacheError, KVCacheExhausted, PagedKVCache, VirtualKVCache, paged_spec
from tests.conftest import BACKENDS, check_invariants, make_spec, make_vmm


def read(cache, slot: int, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(cache, PagedKVCache):
        k, v = cache.gather(layer, slot)
        return k[:n, 0, 0].cpu(), v[:n, 0, 0].cpu()
    return cache.k(layer)[slot, :n, 0, 0].cpu(), cache.v(layer)[slot, :n, 0, 0].cpu()


class CacheMachine(RuleBasedStateMachine):
    def __init__(self, make_cache):
        super().__init__()
        self.cache = make_cache()
        self.spec = self.cache.spec
        self.model: dict[int, list[float]] = {}
        self.next_value = 1.0
        self.virtual = isinstance(self.cache, VirtualKVCache)

    def teardown(self) -> None:
        if self.virtual:
            self.cache.close()
            self.cache._vmm.close()

    tokens = st.integers(min_value=0, max_value=10**6)

    def _tokens(self, raw: int) -> int:
        return raw % (self.spec.max_tokens + 1)

    def _live(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.model)))

    @rule(expected=tokens)
    def alloc(self, expected):
        if len(self.model) == self.spec.max_slots:
            with pytest.raises(KVCacheError, match="slots are in use"):
                self.cache.alloc_slot(self._tokens(expected))
            return
        slot = self.cache.alloc_slot(self._tokens(expected))
        assert slot not in self.model
        self.model[slot] = []

    @precondition(lambda self: self.model)
    @rule(data=st.data(), raw=tokens)
    def ensure(self, data, raw):
        slot, tokens = self._live(data), self._tokens(raw)
        before = self.cache.stats()
        try:
            self.cache.ensure(slot, tokens)
        except KVCacheExhausted as exc:
            assert self.cache.stats() == before
            assert exc.needed_pages > exc.free_pages
            return
        held = self.model[slot]
        if tokens <= len(held):
            del held[tokens:]
            return
        new = [self.next_value + i for i in range(tokens - len(held))]
        self.next_value += len(new)
        value = torch.tensor(new, device=self.cache.device)[:, None, None].expand(-1, self.spec.num_kv_heads, self.spec.head_dim)
        for layer in {0, self.spec.num_layers - 1}:
            self.cache.write(layer, slot, len(held), value, -value)
        held.extend(new)

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data(), raw=tokens)
    def share(self, data, raw):
        src = self._live(data)
        dst = data.draw(st.sampled_from(sorted(set(self.model) - {src})))
        if not self.model[src]:
            return
        tokens = 1 + raw % len(self.model[src])
        self.cache.share_prefix(src, dst, tokens)
        self.model[dst] = self.model[src][:tokens]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        slot = self._live(data)
        self.cache.free_slot(slot)
        del self.model[slot]
        with pytest.raises(ValueError, match="not in use"):
            self.cache.free_slot(slot)

    @rule(pages=st.integers(0, 40))
    def reclaim(self, pages):
        free_before = self.cache.stats().free_pages
        freed = self.cache.reclaim(pages)
        assert self.cache.stats().free_pages == free_before + freed

    @precondition(lambda self: self.virtual)
    @rule(pages=st.integers(0, 8))
    def grow(self, pages):
        nbytes = pages * self.spec.page_size
        assert self.cache.grow(nbytes) == nbytes

    @precondition(lambda self: self.virtual)
    @rule(pages=st.integers(0, 8))
    def shrink(self, pages):
        before = self.cache.stats()
        released = self.cache.shrink(pages * self.spec.page_size)
        assert released == min(pages, before.free_pages) * self.spec.page_size
        assert self.cache.stats().pool_bytes == before.pool_bytes - released

    @invariant()
    def bookkeeping_holds(self):
        check_invariants(self.cache)
        stats = self.cache.stats()
        assert stats.slots_in_use == len(self.model)
        assert 0 <= stats.used_bytes <= stats.mapped_bytes
        unit = self.spec.page_size if self.virtual else self.cache.block_bytes
        assert stats.mapped_bytes + stats.free_pages * unit == stats.pool_bytes

    @invariant()
    def zero_pages_back_each_slots_guard(self):
        """Past each slot's mapped pages, the guard's worth of pages (all of them without a guard) reads zeros."""
        if not self.virtual or not self.cache.zero_unmapped:
            return
        cache, size = self.cache, self.spec.page_size
        for slot, state in enumerate(cache._slots):
            first = len(state.pages)
            stop = min(first + cache._guard, self.spec.pages_per_slot)
            for flat in cache._flat:
                lo = cache._offset(slot, first)
                assert not torch.count_nonzero(flat[lo : lo + (stop - first) * size]), f"slot {slot}'s guard is not zeros"

    @invariant()
    def contents_match_the_model(self):
        for slot, held in self.model.items():
            want = torch.tensor(held, dtype=torch.float32)
            for layer in {0, self.spec.num_layers - 1}:
                k, v = read(self.cache, slot, layer, len(held))
                assert torch.equal(k, want), f"slot {slot} layer {layer} K differs from the model"
                assert torch.equal(v, -want), f"slot {slot} layer {layer} V differs from the model"


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["mega", "per_layer"])
@pytest.mark.parametrize("guard_tokens", [None, 1], ids=["zero everywhere", "guard"])
def test_virtual_cache_state_machine(backend, layout, guard_tokens):
    vmm_probe = make_vmm(backend)  # skips without CUDA
    vmm_probe.close()
    spec = make_spec(backend, layout, max_slots=4, pages_per_slot=3)

    def make_cache():
        return VirtualKVCache(spec, 6 * spec.num_buffers * spec.page_size, make_vmm(backend), guard_tokens=guard_tokens)

    run_state_machine_as_test(lambda: CacheMachine(make_cache), settings=SETTINGS)


def test_paged_cache_state_machine():
    spec = paged_spec(2, 2, 4, block_size=4, dtype=torch.float32, max_slots=4, max_tokens=24)

    def make_cache():
        return PagedKVCache(spec, 10 * spec.page_size * spec.bytes_per_token)

    run_state_machine_as_test(lambda: CacheMachine(make_cache), settings=SETTINGS)
