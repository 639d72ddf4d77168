"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled. ``temperature=0`` is greedy; a ``seed`` makes sampling reproducible
    whatever else is in the batch (and across preemption by recompute)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token; 0: only the sampled token's

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
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens > 0, "an int > 0"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0 (0 turns it off)"),
            ("n", isinstance(self.n, int) and self.n >= 1, "an int >= 1"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "None or 0..20"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflow to inf and softmax gives NaN (vLLM draws the same line).
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def _generator(seed: int, sample_index: int, output_index: int, device: torch.device) -> torch.Generator:
    # One stream per (request seed, parallel sample, output position): independent of batch and history.
    mixed = (seed * 0x9E3779B1 + sample_index * 0x85EBCA77 + output_index * 0xC2B2AE3D) % (1 << 63)
    return torch.Generator(device=device).manual_seed(mixed)


def draw(logits: torch.Tensor, params: SamplingParams, sample_index: int, output_index: int, seed: int) -> torch.Tensor:
    """One token id from ``logits`` ``[vocab]`` (float32) under ``params``, as a 0-dim tensor on their device:
    nothing waits for the device, so the next step can be launched with it before anyone reads it."""
    if params.greedy:
        return torch.argmax(logits)
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # keep the token that crosses top_p
        drop[0] = False  # and the likeliest always: rounding must not leave nothing to draw from
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(-1)
    # torch.multinomial's own draw for one sample (the same token for the same generator), without its input
    # checks, which read values back from the device and so wait for everything queued before them.
    q = torch.empty_like(probs).exponential_(1, generator=_generator(seed, sample_index, output_index, logits.device))
    return (probs / q).argmax()
