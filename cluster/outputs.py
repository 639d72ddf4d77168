"""What generation returns: RequestOutput with one CompletionOutput per parallel sample."""

from __future__ import annotations

from dataclasses import dataclass

from worker.sampling import SampledToken


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running
    logprobs: tuple[SampledToken, ...] | None = None
    token_texts: dict[int, str] | None = None  # with logprobs: the text of every token they name


@dataclass(frozen=True)
class RequestMetrics:
    """Seconds since arrival; None until it happened."""

    time_to_first_token: float | None
    time_in_queue: float | None
    e2e_latency: float | None
    num_preemptions: int


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed (its completions end with finish_reason "error")
    # ``prompt_logprobs``: None for the first prompt token, then each one's logprob given those before it (vLLM's)
    prompt_logprobs: tuple[SampledToken | None, ...] | None = None
    prompt_token_texts: dict[int, str] | None = None  # with prompt_logprobs: the text of every token they name

    @classmethod
    def failed(cls, request_id: str, error: str, n: int = 0, logprobs: bool = False, prompt: str | None = None,
               prompt_token_ids: tuple[int, ...] = ()) -> "RequestOutput":
        """The final output of a request that ran nothing: ``n`` empty completions ending in "error"."""
        completions = tuple(CompletionOutput(k, "", (), "error", () if logprobs else None) for k in range(n))
        return cls(request_id, prompt, prompt_token_ids, completions, True, RequestMetrics(None, None, None, 0), error)
