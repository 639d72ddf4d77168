"""Structured outputs: a request's JSON schema, regex, choice or grammar compiled by llguidance, and one matcher per
sequence that the engine advances with every token it gets back and asks for the next token's mask.

The engine holds the matchers (the workers only apply the masks they are sent), so a constrained sequence's mask
needs its last token (vLLM's async scheduler also computes a grammar's mask only after the token it follows). Under
async scheduling the step launched while that token is on the device still takes the sequence: its forward pass is
queued at once and its draw when the mask comes (``EngineCore._supply_masks``: handed to the local worker at once,
sent with the next call to Ray workers that launch ahead).
"""

from __future__ import annotations

import json
from collections import OrderedDict

from worker.sampling import StructuredOutputs
from worker.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` into llguidance grammars for one tokenizer (validated once, cached) and makes
    matchers. Building the tokenizer's index takes a moment: it is made on the first structured request."""

    CACHE = 256  # compiled grammars kept

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll = None
        self._grammars: OrderedDict[StructuredOutputs, str] = OrderedDict()

    @property
    def _lltokenizer(self):
        if self._ll is None:
            import llguidance

            eos = list(self._tokenizer.eos_token_ids) or None
            if isinstance(self._tokenizer, HFTokenizer):
                self._ll = llguidance.LLTokenizer(self._tokenizer.to_json(), n_vocab=self._vocab_size, eos_token=eos)
            elif isinstance(self._tokenizer, ByteTokenizer):
                self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(self._tokenizer, self._vocab_size)),
                                                  slices=[])
            else:
                raise ValueError(f"structured outputs need a tokenizer.json or byte tokenizer, not {type(self._tokenizer).__name__}")
        return self._ll

    def grammar(self, spec: StructuredOutputs) -> str:
        """``spec`` as a validated llguidance grammar; ``ValueError`` naming the field for one that does not compile."""
        if (cached := self._grammars.get(spec)) is not None:
            self._grammars.move_to_end(spec)
            return cached
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        kind = spec.kind
        try:
            if kind == "json":
                schema = json.loads(spec.json)
                grammar = LLMatcher.grammar_from_json_schema(schema)
            elif kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema({"type": "object"})
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(spec.regex)
            elif kind == "choice":
                grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
            else:
                grammar = LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))  # GBNF (``::=``) or Lark
        except Exception as exc:  # llguidance raises its own kinds for a grammar it cannot read
            raise ValueError(f"structured_outputs.{kind} does not compile: {exc}") from None
        if error := LLMatcher.validate_grammar(grammar, self._lltokenizer):
            raise ValueError(f"structured_outputs.{kind} does not compile: {error}")
        self._grammars[spec] = grammar
        if len(self._grammars) > self.CACHE:
            self._grammars.popitem(last=False)
        return grammar

    def matcher(self, grammar: str):
        """A fresh matcher of ``grammar`` (one of ``grammar``'s results), at the output's start."""
        from llguidance import LLMatcher

        return LLMatcher(self._lltokenizer, grammar)


class _ByteVocabulary:
    """The byte tokenizer as llguidance's ``TokenizerWrapper`` reads a tokenizer."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int):
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = 256
        self.tokens = tokenizer.token_bytes(vocab_size)
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())
