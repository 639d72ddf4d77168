"""The batched sampler (``worker.sampling.sample``) on CPU: the distribution it draws from, top-k / top-p, and
draws that depend only on what names them (the seed, the sample, the position), never on the rest of the batch."""

from __future__ import annotations

import math
import re

import pytest
import torch

from worker.sampling import SamplingParams, needs_processing, noise_keys, processed_logits, sample


def draw_many(logits_row: list[float], params: SamplingParams, count: int) -> torch.Tensor:
    logits = torch.tensor([logits_row] * count)
    return sample(logits, [params] * count, [noise_keys(3, 0, position) for position in range(count)])


def test_draws_follow_softmax_of_the_logits_over_temperature():
    probs = [0.5, 0.3, 0.15, 0.05]
    for temperature in (1.0, 0.5):
        tokens = draw_many([math.log(p) * temperature for p in probs], SamplingParams(temperature=temperature), 40_000)
        freq = torch.bincount(tokens, minlength=4).double() / len(tokens)
        assert torch.allclose(freq, torch.tensor(probs, dtype=torch.double), atol=0.01), freq


def test_top_k_and_top_p_leave_only_their_tokens_and_spare_the_other_rows():
    row = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert set(draw_many(row, SamplingParams(top_k=2), 4000).tolist()) == {0, 1}
    assert set(draw_many(row, SamplingParams(top_p=0.65), 4000).tolist()) == {0, 1}  # 0.4 + 0.3 crosses 0.65
    # In one batch: a top-k row, a top-p row and a plain row; the plain one draws what it draws alone.
    plain, keys = SamplingParams(), [noise_keys(5, 0, p) for p in range(3)]
    batch = sample(torch.tensor([row] * 3), [SamplingParams(top_k=1), SamplingParams(top_p=0.1), plain], keys)
    alone = sample(torch.tensor([row]), [plain], keys[2:])
    assert batch.tolist()[:2] == [0, 0] and batch[2] == alone[0]


def test_a_draw_depends_on_its_seed_sample_and_position_only():
    torch.manual_seed(0)
    logits = torch.randn(32, 1000)
    params = [SamplingParams(temperature=0.8, top_k=50 if r % 3 == 0 else 0) for r in range(32)]
    keys = [noise_keys(r, r % 2, 7) for r in range(32)]
    whole = sample(logits, params, keys)
    assert [int(sample(logits[r : r + 1], params[r : r + 1], keys[r : r + 1])) for r in range(32)] == whole.tolist()
    # and the keys tell draws apart: another position (or seed) draws other tokens
    other = sample(logits, params, [noise_keys(r, r % 2, 8) for r in range(32)])
    assert (other != whole).sum() >= 16


def test_a_top_k_row_cuts_only_itself():
    # One top-k row beside rows without: they keep every token (top-k runs over the largest k asked, not the vocab).
    row = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    params = [SamplingParams(top_k=1)] + [SamplingParams()] * 3
    seen = set()
    for position in range(400):
        tokens = sample(torch.tensor([row] * 4), params, [noise_keys(9, r, position) for r in range(4)]).tolist()
        assert tokens[0] == 0
        seen.update(tokens[1:])
    assert seen == {0, 1, 2, 3}


def test_min_p_keeps_the_tokens_at_least_that_share_as_likely_as_the_likeliest_and_spares_other_rows():
    row = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert set(draw_many(row, SamplingParams(min_p=0.5), 4000).tolist()) == {0, 1}  # 0.3 >= 0.25 > 0.15
    assert set(draw_many(row, SamplingParams(min_p=0.3), 4000).tolist()) == {0, 1, 2}
    assert set(draw_many(row, SamplingParams(min_p=1.0), 400).tolist()) == {0}
    # after the temperature: at 0.5 the probabilities are (0.5^2, 0.3^2, ...) normalised, 0.3^2 / 0.5^2 = 0.36
    assert set(draw_many(row, SamplingParams(min_p=0.4, temperature=0.5), 4000).tolist()) == {0}
    plain, keys = SamplingParams(), [noise_keys(5, 0, p) for p in range(2)]
    batch = sample(torch.tensor([row] * 2), [SamplingParams(min_p=1.0), plain], keys)
    assert batch[0] == 0 and batch[1] == sample(torch.tensor([row]), [plain], keys[1:])[0]


def test_logit_bias_is_added_to_its_rows_tokens_only():
    logits = torch.zeros(3, 5)
    params = [SamplingParams(logit_bias={4: 2.5, 1: -100}), SamplingParams(), SamplingParams(logit_bias={0: 1})]
    asks = [(row, p, 0) for row, p in enumerate(params) if needs_processing(p, 0)]
    biased = processed_logits(logits, asks, (3,))
    assert biased.tolist() == [[0, -100, 0, 0, 2.5], [0] * 5, [1, 0, 0, 0, 0]] and not logits.any()
    assert [row for row, _, _ in asks] == [0, 2] and processed_logits(logits, [], (3,)) is logits


def test_min_tokens_bans_eos_and_stop_token_ids_until_a_row_has_made_that_many():
    inf = float("-inf")
    params = [SamplingParams(min_tokens=2, stop_token_ids=[1]), SamplingParams(min_tokens=2, stop_token_ids=[1]),
              SamplingParams(min_tokens=2, ignore_eos=True), SamplingParams(stop_token_ids=[1])]
    made = [1, 2, 0, 0]
    assert [needs_processing(p, m) for p, m in zip(params, made)] == [True, False, True, False]
    out = processed_logits(torch.zeros(4, 5), [(r, p, m) for r, (p, m) in enumerate(zip(params, made))], (3, 4))
    assert out.tolist() == [[0, inf, 0, inf, inf], [0] * 5, [0] * 5, [0] * 5]  # made 1 of 2; made 2; ignores EOS


def test_allowed_token_ids_leave_only_those_tokens_to_their_rows():
    inf = float("-inf")
    params = [SamplingParams(allowed_token_ids=[3, 1, 3]), SamplingParams(),
              SamplingParams(allowed_token_ids=[0, 4], logit_bias={4: 2.0, 2: 1.0})]
    asks = [(row, p, 0) for row, p in enumerate(params) if needs_processing(p, 0)]
    out = processed_logits(torch.zeros(3, 5), asks, (3,))
    assert params[0].allowed_token_ids == (1, 3) and [row for row, _, _ in asks] == [0, 2]
    assert out.tolist() == [[inf, 0, inf, 0, inf], [0] * 5, [0, inf, inf, inf, 2.0]]


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(min_p=1.5), "min_p must be in [0, 1] (0 turns it off), got 1.5"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids must be a list of token ids (ints >= 0), got [-1]"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be None or 0..20, got 21"),
    (dict(min_tokens=20, max_tokens=16), "min_tokens must be an int in [0, max_tokens=16], got 20"),
    (dict(logit_bias={3: 101}), "logit_bias must map token ids (ints >= 0) to biases in [-100, 100], got 3: 101.0"),
    (dict(logit_bias={-1: 1}), "logit_bias must map token ids (ints >= 0) to biases in [-100, 100], got -1: 1.0"),
    (dict(logit_bias={"a": "b"}), "logit_bias must map token ids to numbers, got {'a': 'b'}"),
])
def test_bad_min_p_and_logit_bias_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)
