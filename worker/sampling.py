"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, min-p, logit bias, min tokens, per-request
seeds, logprobs (penalties: ``worker.penalties``)."""

from __future__ import annotations

import json as _json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker import kernels
from worker.staging import to_device


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match (vLLM's ``StructuredOutputsParams``), exactly one of: a JSON schema (``json``, as a
    dict or its JSON text), any JSON object (``json_object``), a regular expression, one of ``choice``'s strings, or
    a ``grammar`` (Lark, or GBNF with ``::=``). Compiled by llguidance into a token mask a step (``cluster.structured``)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {getattr(self, name)!r}")
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got "
                             f"{given or 'none'}")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n) not in (None, False))


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled. ``temperature=0`` is greedy; a ``seed`` makes sampling reproducible
    whatever else is in the batch (and across preemption by recompute)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # drop tokens less likely than this share of the likeliest one's probability; 0: off
    # Added to a token's logit before anything else (greedy too): OpenAI's -100..100, as (token id, bias) pairs;
    # a dict is accepted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's: subtracted once from every token the output holds (presence), once per time it holds it (frequency).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (CTRL's): a token of the prompt or the output has a positive logit divided by this, a negative one
    # multiplied; 1: off.
    repetition_penalty: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0  # EOS and stop_token_ids cannot be drawn before this many (vLLM's); stop strings still end it
    include_stop_str_in_output: bool = False  # the stop string that ended the output stays in its text (vLLM's)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # the output text leaves special tokens (EOS, a template's markers) out
    structured_outputs: StructuredOutputs | None = None  # what the output must match (JSON schema, regex, ...)
    # vLLM's: words the output must not contain (each as written and after a space); a word of several tokens bans its
    # last one where the output ends in the others.
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these may be drawn (empty: any)
    logprobs: int | None = None  # top alternatives per token; 0: only the sampled token's
    # vLLM's: each prompt token's logprob given the ones before it, with this many alternatives (the first token has
    # none); the prompt is computed whole for it (no cached prefix).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.allowed_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids
        ):
            raise ValueError(f"allowed_token_ids must be a list of token ids (ints >= 0), got {self.allowed_token_ids!r}")
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(self.allowed_token_ids))))
        if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((t, float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        for token, b in bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or not -100 <= b <= 100:
                raise ValueError(f"logit_bias must map token ids (ints >= 0) to biases in [-100, 100], got {token!r}: {b!r}")
        object.__setattr__(self, "logit_bias", bias)
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens > 0, "an int > 0"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0 (0 turns it off)"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1] (0 turns it off)"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty < float("inf"), "a finite number > 0 (1 turns it off)"),
            ("n", isinstance(self.n, int) and self.n >= 1, "an int >= 1"),
            ("min_tokens", isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"an int in [0, max_tokens={self.max_tokens}]"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "None or 0..20"),
            ("prompt_logprobs", self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                                 and 0 <= self.prompt_logprobs <= 20), "None or 0..20"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

    @property
    def penalized(self) -> bool:
        """Whether the tokens already in the sequence change this one's logits (``worker.penalties``)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflow to inf and softmax gives NaN (vLLM draws the same line).
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def noise_keys(seed: int, sample_index: int, output_index: int) -> tuple[int, int]:
    """The two words naming one draw's noise (``kernels.gumbel_argmax``): one stream per (request seed, parallel
    sample, output position) -- independent of the batch, the step and the rank that draws it."""
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + output_index * 0x94D049BB133111EB) % (1 << 64)
    # splitmix64's finalizer: nearby (seed, sample, position) triples give unrelated words
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return x & 0xFFFFFFFF, x >> 32


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[tuple[int, int]]) -> torch.Tensor:
    """One token id per row of ``logits`` ``[rows, vocab]`` (float32, or the model's dtype, read as float32), drawn
    under that row's ``params`` (none greedy) with the noise its ``keys`` name (``noise_keys``), for the whole batch
    at once and on the device: nothing waits for the device, so the next step can be launched with the result
    before anyone reads it."""
    device = logits.device
    temperature = to_device(torch.tensor([p.temperature for p in params], dtype=torch.float32), device)
    key_words = to_device(torch.tensor(keys, dtype=torch.int64).reshape(len(params), 2), device)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if not any(top_k) and all(p == 1.0 for p in top_p) and not any(min_p):
        return kernels.gumbel_argmax(logits, temperature, key_words)
    scaled = logits / temperature[:, None]
    if any(min_p):
        # p >= min_p * p_max is logit >= max logit + log(min_p), after the temperature (vLLM's order); rows at 0 keep all
        floor = torch.log(to_device(torch.tensor(min_p, dtype=torch.float32), device))
        scaled = scaled.masked_fill(scaled < scaled.max(-1, keepdim=True).values + floor[:, None], float("-inf"))
    if any(top_k):
        # The largest k on the host (reading it from the device would wait for the step); rows without top-k keep all.
        k_host = [min(k, scaled.shape[-1]) for k in top_k]
        k = to_device(torch.tensor(k_host), device)[:, None]
        kth = torch.topk(scaled, max(k_host)).values.gather(1, (k - 1).clamp(min=0))
        scaled = scaled.masked_fill((scaled < kth) & (k > 0), float("-inf"))
    if any(p < 1.0 for p in top_p):
        p = to_device(torch.tensor(top_p, dtype=torch.float32), device)
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # keep the token that crosses top_p, and a row without top_p whole (its cumsum may round past 1)
        drop = (sorted_probs.cumsum(-1) - sorted_probs >= p[:, None]) & (p < 1.0)[:, None]
        drop[:, 0] = False  # and the likeliest always: rounding must not leave nothing to draw from
        scaled = scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return kernels.gumbel_argmax(scaled, torch.ones_like(temperature), key_words)


def processed_logits(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams, int]],
                     eos_token_ids: tuple[int, ...], banned: Sequence[tuple[int, Sequence[int]]] = ()) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` as the draw sees them. ``rows``: ``(row, params, made)`` of the rows whose params
    ask for it (``needs_processing``; ``made``: the tokens its sequence made before this one): their ``logit_bias``
    added, and their EOS (unless they ignore EOS) and ``stop_token_ids`` at -inf while they have made fewer than
    ``min_tokens``, and every token but their ``allowed_token_ids`` at -inf; ``banned``: ``(row, token ids)`` at -inf
    (bad words). One scatter for the batch, its indices built on the host, and one masked add for the rows with
    allowed tokens; the same tensor where nothing applies."""
    entries = [(row, token, float("-inf")) for row, ids in banned for token in ids if token < logits.shape[-1]]
    for row, p, made in rows:
        entries += [(row, token, bias) for token, bias in p.logit_bias]
        if made < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            entries += [(row, token, float("-inf")) for token in sorted(banned) if token < logits.shape[-1]]
    if entries:
        index = to_device(torch.tensor([[r, t] for r, t, _ in entries], dtype=torch.int64), logits.device)
        values = to_device(torch.tensor([b for _, _, b in entries], dtype=logits.dtype), logits.device)
        logits = logits.index_put((index[:, 0], index[:, 1]), values, accumulate=True)
    only = [(row, p.allowed_token_ids) for row, p, _ in rows if p.allowed_token_ids]
    if only:
        # -inf over each such row, 0 at its allowed ids, added: what was -inf (a bias, a ban) stays so.
        # Made on the device: only the ids and rows cross, not a vocabulary-wide row each.
        keep = to_device(torch.tensor([[i, t] for i, (_, ids) in enumerate(only) for t in ids if t < logits.shape[-1]],
                                      dtype=torch.int64), logits.device)
        mask = torch.full((len(only), logits.shape[-1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        mask[keep[:, 0], keep[:, 1]] = 0
        rows_of = to_device(torch.tensor([row for row, _ in only], dtype=torch.int64), logits.device)
        logits = logits.index_add(0, rows_of, mask)
    return logits


def needs_processing(params: SamplingParams, made: int) -> bool:
    """Whether ``processed_logits`` changes a row with these params whose sequence made ``made`` tokens."""
    return bool(params.logit_bias or params.allowed_token_ids) or made < params.min_tokens


def grammar_masked(logits: torch.Tensor, rows: Sequence[tuple[int, bytes]]) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with every token a row's grammar does not allow at -inf: ``rows`` are ``(row,
    bitmask)``, a bit per token id in little-endian 32-bit words (llguidance's). One unpacking for the batch."""
    words = torch.frombuffer(bytearray(b"".join(mask for _, mask in rows)), dtype=torch.int32).view(len(rows), -1)
    words = to_device(words, logits.device)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
    allowed = bits.view(len(rows), -1)[:, : logits.shape[-1]].bool()
    at = to_device(torch.tensor([row for row, _ in rows]), logits.device)
    out = logits.clone()
    out[at] = logits[at].masked_fill(~allowed, float("-inf"))
    return out

