"""Prefix caching in the engine (tiny model, float32, CPU): exact hits on constructed prompts, the same greedy
tokens with caching on and off on every layout -- chunked, under 4x memory oversubscription, with both preemption
modes -- and the worker's cache agreeing with the ledger throughout."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from cluster.engine import LLM
from tests.conftest import check_invariants
from worker.config import PRESETS
from worker.loader import random_model
from worker.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SMALL = dict(device="cpu", max_num_seqs=8, max_model_len=256, page_size=4096, block_size=16, kv_memory=4 << 20)


def hit_tokens(llm: LLM, prompt, params: SamplingParams = GREEDY) -> tuple[int, list[int]]:
    """(prompt tokens found cached, output token ids) of one request run alone."""
    before = llm.scheduler.prefix_hits
    (out,) = llm.generate(prompt, params)
    return llm.scheduler.prefix_hits - before, list(out.outputs[0].token_ids)


def test_hits_count_the_full_blocks_a_prompt_shares_with_what_ran_before():
    with LLM("tiny", **SMALL) as llm:
        block = llm.core.ledger.spec.tokens_within(1)
        rng = random.Random(0)
        base = [rng.randint(3, 200) for _ in range(5 * block + 3)]
        assert hit_tokens(llm, base)[0] == 0
        assert hit_tokens(llm, base)[0] == 5 * block  # every full block
        assert hit_tokens(llm, base[: 4 * block] + [1, 2, 3])[0] == 4 * block
        changed = base[: 4 * block - 1] + [base[4 * block - 1] + 1] + base[4 * block :]
        assert hit_tokens(llm, changed)[0] == 3 * block  # its fourth block differs in its last token
        assert hit_tokens(llm, base[: 2 * block])[0] == block  # the last prompt token is always computed
        salted = {"prompt_token_ids": base, "cache_salt": "tenant-a"}
        assert hit_tokens(llm, salted)[0] == 0  # another tenant's blocks are not found
        assert hit_tokens(llm, salted)[0] == 5 * block  # its own are
        assert llm.scheduler.prefix_queries == 5 * len(base) + (4 * block + 3) + 2 * block  # every prompt token


def test_a_conversations_next_turn_finds_the_previous_answer():
    with LLM("tiny", **SMALL) as llm:
        block = llm.core.ledger.spec.tokens_within(1)
        prompt = list(range(10, 10 + 2 * block + 4))
        _, answer = hit_tokens(llm, prompt)
        # The last output token was sampled, never fed back: its K/V was not computed.
        computed = len(prompt) + len(answer) - 1
        hits, _ = hit_tokens(llm, prompt + answer + [5, 6, 7])
        assert hits == computed // block * block


def _shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randint(3, 300) for _ in range(rng.randint(20, 70))] for _ in range(3)]
    return [rng.choice(systems) + [rng.randint(3, 300) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("layout", ["mega", "per_layer", "paged"])
@pytest.mark.parametrize("case", ["default", "chunked", "oversubscribed-recompute", "oversubscribed-swap"])
def test_greedy_tokens_are_the_same_with_prefix_caching_on_and_off(layout, case):
    prompts = _shared_prefix_prompts(24)
    kw = dict(SMALL, kv_layout=layout)
    params = GREEDY
    if case == "chunked":
        kw["max_num_batched_tokens"] = 24
    if case.startswith("oversubscribed"):
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)  # running requests grow: preemption
        with LLM("tiny", **kw) as probe:
            spec = probe.core.ledger.spec
        demand = sum(spec.physical_bytes_for(len(p) + params.max_tokens) for p in prompts)
        # 8x oversubscribed counting every prompt's own blocks; the shared prefixes make it about 4x with caching.
        kw.update(kv_memory=demand // 8, preemption_mode=case.split("-")[1])
    runs = {}
    # Off, on, and on with cached prefixes fused into one allocation on their first reuse (virtual layouts).
    for caching, fused in [(False, 0), (True, 0)] + ([(True, 2)] if layout != "paged" else []):
        with LLM("tiny", enable_prefix_caching=caching, fused_prefix_pages=fused, **kw) as llm:
            # Twice: the second pass finds the first one's blocks, the first finds its own earlier requests'.
            runs[caching, fused] = [_tokens(llm.generate(prompts, params)) for _ in range(2)]
            s = llm.scheduler
            assert (s.prefix_hits > 0) == caching
            if case == "default":  # (the tighter cases map most prefixes into free slots ahead: nothing to fuse)
                assert (llm.core.ledger.prefix_runs_fused > 0) == bool(fused)
            # requests waiting behind the running ones had their prefixes mapped ahead, where slots keep pages
            assert (llm.core.ledger.prefix_pages_ahead > 0) == (caching and layout != "paged")
            if case.startswith("oversubscribed"):
                assert s.num_preemptions > 0
            assert llm.core.ledger.accounting() == llm.cache.accounting()
            check_invariants(llm.cache)
    assert runs[True, 0] == runs[False, 0] == runs.get((True, 2), runs[False, 0])
    assert runs[False, 0][0] == runs[False, 0][1]


def test_async_scheduling_caches_blocks_once_their_tokens_are_known():
    """With two steps in flight a sequence's newest token is a placeholder when its block fills: the block is
    indexed a step later, and the tokens are those of one step at a time."""
    prompts = _shared_prefix_prompts(16, seed=1)
    runs = {}
    for overlap in (False, True):
        with LLM("tiny", async_scheduling=overlap, **SMALL) as llm:
            runs[overlap] = [_tokens(llm.generate(prompts, GREEDY)) for _ in range(2)]
            assert llm.scheduler.prefix_hits > 0
            assert llm.core.ledger.accounting() == llm.cache.accounting()
    assert runs[True] == runs[False]


def test_cache_salt_must_be_a_non_empty_string_and_prompt_dicts_name_one_prompt():
    with LLM("tiny", **SMALL) as llm:
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string, got ''"):
            llm.generate({"prompt": "hi", "cache_salt": ""})
        with pytest.raises(ValueError, match="exactly one of 'prompt' and 'prompt_token_ids'"):
            llm.generate({"prompt": "hi", "prompt_token_ids": [5]})
        with pytest.raises(ValueError, match=r"unknown keys \['salt'\]"):
            llm.generate({"prompt": "hi", "salt": "x"})
        assert llm.generate({"prompt": "hi", "cache_salt": "x"}, GREEDY)[0].outputs[0].finish_reason == "length"


def test_pages_that_do_not_hold_whole_tokens_are_cached_and_the_split_token_computed_again():
    """Three layers: a ``mega`` token is 768 bytes, 16/3 of them a 4 KiB page. A hit maps whole pages and computes
    again from the first token that runs past them (copying the shared page its first bytes are in); the tokens
    equal those without caching."""
    model = random_model(replace(PRESETS["tiny"], num_layers=3), torch.float32, "cpu")
    prompts = _shared_prefix_prompts(12, seed=3)
    runs = {}
    for caching in (False, True):
        with LLM(model, enable_prefix_caching=caching, **SMALL) as llm:
            spec = llm.core.ledger.spec
            assert spec.token_bytes == 768 and spec.page_tokens(1) == (5, 11)
            runs[caching] = [_tokens(llm.generate(prompts, GREEDY)) for _ in range(2)]
            hits = llm.scheduler.prefix_hits
            assert (hits > 0) == caching
            assert llm.core.ledger.accounting() == llm.cache.accounting()
            check_invariants(llm.cache)
    assert runs[True] == runs[False]
