"""Presence, frequency and repetition penalties: the engine's greedy tokens equal transformers' generate with the
same penalties (its ``RepetitionPenaltyLogitsProcessor``, and OpenAI's presence / frequency formula over the
generated tokens), with async scheduling on and off, chunked, under memory pressure, with prefixes cached."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from cluster.engine import LLM
from tests.cluster.conftest import NEW_TOKENS
from worker.penalties import PenaltyState
from worker.sampling import SamplingParams


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's: ``logit - count * frequency - (count > 0) * presence``, counts over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


PENALTIES = [
    dict(repetition_penalty=1.5),
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=2.0),
]


@pytest.fixture(scope="module")
def reference(hf_llama):
    """For each of ``PENALTIES``: transformers' greedy continuation of every prompt under it."""
    path, prompts, _ = hf_llama
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine ignores EOS; min_new_tokens would ban it instead
    out = {}
    for k, penalty in enumerate(PENALTIES):
        expected = []
        for p in prompts:
            # transformers applies its own processors (repetition) before the caller's (OpenAI's), vLLM's order
            extra = LogitsProcessorList([OpenAIPenalties(len(p), penalty.get("presence_penalty", 0.0),
                                                         penalty.get("frequency_penalty", 0.0))])
            with torch.no_grad():
                ids = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, logits_processor=extra,
                                     repetition_penalty=penalty.get("repetition_penalty", 1.0))
            expected.append(ids[0, len(p):].tolist())
        out[k] = expected
    return out


def engine(path: str, **kw) -> LLM:
    defaults = dict(dtype="float32", device="cpu", max_num_seqs=8, max_model_len=128, page_size=4096, kv_memory=4 << 20)
    return LLM(path, **{**defaults, **kw})


@pytest.mark.parametrize("k", range(len(PENALTIES)))
@pytest.mark.parametrize("mode", [
    dict(),
    dict(async_scheduling=False),
    dict(max_num_batched_tokens=7),  # chunked prefill
    dict(kv_layout="paged", block_size=16),
])
def test_penalties_match_transformers(hf_llama, reference, k, mode):
    path, prompts, plain = hf_llama
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **PENALTIES[k])
    with engine(path, **mode) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        # a penalty changes tokens, and the engine draws every one the way transformers does
        assert got != plain and got == reference[k]
        assert len(llm.core.executor.worker.runner._penalties) == 0  # every finished sequence forgotten


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_penalties_survive_preemption_and_share_a_batch_with_plain_requests(hf_llama, reference, preemption_mode):
    path, prompts, plain = hf_llama
    penalized = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **PENALTIES[2])
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    probe = engine(path)
    demand = sum(probe.cache.spec.physical_bytes_for(len(p) + NEW_TOKENS) for p in prompts)
    probe.close()
    with engine(path, kv_memory=demand // 3, preemption_mode=preemption_mode) as llm:
        outs = llm.generate(prompts + prompts, [penalized] * len(prompts) + [greedy] * len(prompts))
        got = [list(o.outputs[0].token_ids) for o in outs]
        assert llm.scheduler.num_preemptions > 0
        assert got[: len(prompts)] == reference[2] and got[len(prompts):] == plain


def test_a_cached_prefix_still_counts_in_the_repetition_penalty(hf_llama, reference):
    """The second run maps the prompts' pages from the cache (the worker never sees those tokens again): the
    penalty still sees the whole prompt."""
    path, prompts, _ = hf_llama
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **PENALTIES[0])
    with engine(path, kv_layout="paged", block_size=4) as llm:
        first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        hits = llm.scheduler.prefix_hits
        second = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        assert llm.scheduler.prefix_hits > hits
        assert first == second == reference[0]


def test_n_forks_count_their_own_output(hf_llama, reference):
    """n = 3 greedy samples with penalties are the n = 1 answer three times: each fork starts counting from its own
    first token (drawn by its parent's row) and the prompt, as the parent does."""
    path, prompts, _ = hf_llama
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, n=3, **PENALTIES[2])
    with engine(path) as llm:
        outs = llm.generate(prompts, params)
        assert [[list(c.token_ids) for c in o.outputs] for o in outs] == [[want] * 3 for want in reference[2]]


def test_penalty_state_reuses_rows_and_grows():
    state = PenaltyState(10, torch.device("cpu"))
    for seq in range(20):
        state.add(seq, (1, 2), (3, 3))
    for seq in range(0, 20, 2):
        state.forget(seq)
    state.add(100, (), (4,))
    logits = torch.zeros(2, 10) + torch.arange(10.0) - 5
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)] * 2
    out = state.apply(logits, [0, 1], [1, 100], params)
    # seq 1: prompt {1, 2} (logits -4, -3: times 2), output {3: 2} (-2 * 2 - 2 - 0.5); seq 100: output {4: 1}
    assert out[0].tolist() == [-5, -8, -6, -6.5, -1, 0, 1, 2, 3, 4]
    assert out[1].tolist() == [-5, -4, -3, -2, -3.5, 0, 1, 2, 3, 4]
    state.record([1, 100], torch.tensor([9, 4]))
    out = state.apply(logits, [0, 1], [1, 100], params)
    assert out[0, 9].item() == 4 / 2 - 1 - 0.5 and out[1, 4].item() == -1 * 2 - 2 - 0.5
    assert len(state) == 11 and state._counts.shape[0] == 32


def test_bad_words_never_appear_whole_launched_ahead_or_not():
    """vLLM's ``bad_words``: a one-token word is never drawn; a word of several tokens never completed (its last
    token banned where the output ends in the others), written alone or after a space; the rest of the output is the
    greedy one's until the first ban, and async scheduling gives the same tokens as one step at a time."""
    forced = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logit_bias={ord("a"): 100, ord(" "): 99})
    runs = []
    for overlap in (True, False):
        with LLM("tiny", device="cpu", max_model_len=128, kv_memory=8 << 20, async_scheduling=overlap) as llm:
            free = llm.generate(["x"], forced)[0].outputs[0].text
            assert free == "a" * 24  # what the bias alone gives
            once = llm.generate(["x"], replace(forced, bad_words=("aa",)))[0].outputs[0].text
            never = llm.generate(["x", "y"], [replace(forced, bad_words=("a",)), forced])
            spaced = llm.generate(["x"], replace(forced, bad_words=("a a",)))[0].outputs[0].text
            runs.append((once, [o.outputs[0].text for o in never], spaced))
    once, (never, beside), spaced = runs[0]
    assert "aa" not in once and once.startswith("a ") and once.count("a") == 12  # 'a' then the runner-up, ' '
    assert "a" not in never and beside == "a" * 24
    assert "a a" not in spaced and " a a" not in spaced and spaced.startswith("a")
    assert runs[0] == runs[1]
