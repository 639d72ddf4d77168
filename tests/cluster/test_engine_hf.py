"""The engine's greedy tokens equal transformers' generate, on every KV layout, chunked, and under
memory pressure with both preemption modes; memory accounting returns to zero."""

from __future__ import annotations

import pytest

from cluster.engine import LLM
from tests.cluster.conftest import NEW_TOKENS
from worker.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
LAYOUTS = ["mega", "per_layer", "paged"]


def engine(path: str, layout: str, **kw) -> LLM:
    defaults = dict(kv_layout=layout, dtype="float32", device="cpu", max_num_seqs=8, max_model_len=128,
                    page_size=4096, block_size=16, kv_memory=4 << 20)
    return LLM(path, **{**defaults, **kw})


def assert_drained(llm: LLM) -> None:
    assert llm.core.ledger.accounting() == llm.cache.accounting()  # the worker replayed every decision
    stats = llm.cache.stats()
    assert (stats.slots_in_use, stats.used_bytes) == (0, 0)
    kept = llm.cache.accounting().kept_pages
    assert llm.reset_prefix_cache() == kept  # the cached prefixes' blocks, dropped on every worker too
    assert llm.core.ledger.accounting() == llm.cache.accounting() and llm.cache.accounting().kept_pages == 0
    llm.cache.reclaim(10**9)
    stats = llm.cache.stats()
    assert stats.mapped_bytes == 0
    assert not llm.scheduler.running and not llm.scheduler.waiting


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_matches_transformers(hf_model, layout):
    path, prompts, expected = hf_model
    with engine(path, layout) as llm:
        outputs = llm.generate(prompts, GREEDY)
        assert tokens(outputs) == expected
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        assert_drained(llm)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_prefill_matches(hf_model, layout):
    path, prompts, expected = hf_model
    with engine(path, layout, max_num_batched_tokens=7) as llm:  # every prompt but one is split
        assert tokens(llm.generate(prompts, GREEDY)) == expected
        assert_drained(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_oversubscribed_memory_preempts_and_still_matches(hf_model, layout, mode):
    path, prompts, expected = hf_model
    probe = engine(path, layout)
    demand = sum(probe.cache.spec.physical_bytes_for(len(p) + NEW_TOKENS) for p in prompts)
    probe.close()
    with engine(path, layout, kv_memory=demand // 4, preemption_mode=mode) as llm:
        assert tokens(llm.generate(prompts, GREEDY)) == expected
        assert llm.scheduler.num_preemptions > 0
        if mode == "swap":
            assert llm.scheduler.swap_used_bytes == 0 and llm.core.executor.worker.swap.used_bytes == 0
        assert_drained(llm)
