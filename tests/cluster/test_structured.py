"""Structured outputs (``cluster.structured``, llguidance): sampled outputs of a random model match their JSON schema,
regex, choice or grammar -- with async scheduling and without (the same seeded tokens), n > 1 forks, a batch mixing
constrained and free requests -- and a grammar that does not compile is refused naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from cluster.engine import LLM
from worker.sampling import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
CASES = {
    "json": (StructuredOutputs(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "json_object": (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    "regex": (StructuredOutputs(regex=r"[a-c]{2,4}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", t)),
    "choice": (StructuredOutputs(choice=["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")),
    "grammar": (StructuredOutputs(grammar='root ::= ("ab" | "c")+ "."'), lambda t: re.fullmatch(r"(ab|c)+\.", t)),
}


@pytest.fixture(scope="module")
def engines():
    kw = dict(device="cpu", max_model_len=512, kv_memory=32 << 20, max_num_seqs=8)
    with (LLM("tiny", **kw) as overlapped, LLM("tiny", async_scheduling=False, **kw) as sync,
          LLM("tiny", async_depth=3, **kw) as deeper):
        yield overlapped, sync, deeper


@pytest.mark.parametrize("kind", CASES)
def test_sampled_outputs_match_their_structure_launched_ahead_or_not(engines, kind):
    spec, valid = CASES[kind]
    constrained = SamplingParams(max_tokens=400, temperature=1.0, seed=7, n=2, structured_outputs=spec)
    free = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    prompts = ["hello", "a b c", [5, 6, 7, 8], "zz"]
    runs = []
    for llm in engines:
        outs = llm.generate(prompts, [constrained, free, constrained, constrained])
        runs.append([[(c.text, c.finish_reason) for c in o.outputs] for o in outs])
        for i in (0, 2, 3):
            for c in outs[i].outputs:
                assert c.finish_reason == "stop" and valid(c.text), (kind, c.text)
        assert len(outs[1].outputs[0].token_ids) == 30  # the free request beside them runs as it would alone
        assert llm.core.ledger.accounting() == llm.cache.accounting() and not llm.scheduler.running
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize(("spec", "message"), [
    (dict(regex="("), "structured_outputs.regex does not compile"),
    (dict(json={"type": "nonsense"}), "structured_outputs.json does not compile: Invalid type: nonsense"),
    (dict(grammar="start: ???"), "structured_outputs.grammar does not compile"),
    (dict(json="{not json"), "structured_outputs.json does not compile"),
])
def test_a_structure_that_does_not_compile_is_refused_naming_it(engines, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engines[0].generate("hi", SamplingParams(structured_outputs=StructuredOutputs(**spec)))


@pytest.mark.parametrize(("spec", "message"), [
    (dict(), "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got none"),
    (dict(regex="a", choice=["b"]), "got ['regex', 'choice']"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list of strings, got []"),
])
def test_structured_outputs_take_exactly_one_structure(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputs(**spec)


def test_a_constrained_request_samples_every_step_launched_ahead(engines):
    """Under async scheduling its mask follows the launch (the draw waits for it, not the forward pass), so a
    constrained request beside a free one does not sit out every other step: 60 tokens in about as many steps as
    the free request's 62, not twice as many."""
    overlapped = engines[0]
    constrained = SamplingParams(max_tokens=200, temperature=1.0, seed=5, structured_outputs=StructuredOutputs(regex="[ab]{60}"))
    free = SamplingParams(max_tokens=62, temperature=1.0, seed=3, ignore_eos=True)
    before = overlapped.core.num_steps
    out, _ = overlapped.generate(["go", "on"], [constrained, free])
    assert re.fullmatch("[ab]{60}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    assert overlapped.core.num_steps - before <= 66
    assert overlapped.core.ledger.accounting() == overlapped.cache.accounting() and not overlapped.scheduler.running
