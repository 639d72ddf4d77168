"""Text for the API: streamed deltas that never take back what they sent, and OpenAI's logprob shapes."""

from __future__ import annotations

from collections.abc import Sequence

from cluster.outputs import RequestOutput
from worker.sampling import SampledToken
from server import protocol as p


class TextStream:
    """One completion's text as it grows. The engine's text so far can still change at its end: a byte
    sequence not yet a whole character decodes as U+FFFD, and the start of a stop string is cut once the
    rest of it arrives. So a delta holds those back until they settle or the completion ends. Every new
    token still makes a delta (perhaps of no text), as vLLM's server does: clients see each step, and a
    streamed token's logprobs go out with it."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.sent = ""
        self.tokens = 0  # tokens whose delta went out
        self.ended = False

    def advance(self, text: str, tokens: int, finished: bool) -> str | None:
        """The new text to send ("" when only new tokens or the end moved), or None when nothing moved."""
        if self.ended:
            return None
        if not finished:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._stop_prefix(text)]
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""  # the hold-back never takes text back
        moved = delta or finished or tokens > self.tokens
        self.sent += delta
        self.tokens = max(self.tokens, tokens)
        self.ended = finished
        return delta if moved else None

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
                   default=0)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def completion_logprobs(entries: Sequence[SampledToken], texts: dict[int, str], offset: int = 0) -> p.CompletionLogprobs:
    """``entries``: the tokens' logprobs; ``offset``: where the first token's text starts in the completion."""
    out = p.CompletionLogprobs()
    for t in entries:
        token = texts.get(t.token_id, "")
        out.tokens.append(token)
        out.token_logprobs.append(t.logprob)
        out.top_logprobs.append({texts.get(i, ""): lp for i, lp in (t.top_logprobs or {}).items()} or None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def with_prompt(out: RequestOutput, completion: p.CompletionLogprobs) -> p.CompletionLogprobs:
    """An echoed completion's logprobs (OpenAI's legacy shape): every prompt token first -- the first with no
    logprob, the others with theirs given the tokens before them -- then the completion's."""
    entries = [SampledToken(out.prompt_token_ids[0]), *(out.prompt_logprobs or (None,))[1:]] if out.prompt_token_ids else []
    prompt = completion_logprobs(entries, out.prompt_token_texts or {})
    return p.CompletionLogprobs(**{field: getattr(prompt, field) + getattr(completion, field)
                                   for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset")})


def chat_logprobs(entries: Sequence[SampledToken], texts: dict[int, str]) -> p.ChatLogprobs:
    content = []
    for t in entries:
        token = texts.get(t.token_id, "")
        top = [p.TopLogprob(token=texts.get(i, ""), logprob=lp, bytes=_bytes(texts.get(i, "")))
               for i, lp in (t.top_logprobs or {}).items()]
        content.append(p.TokenLogprob(token=token, logprob=t.logprob, bytes=_bytes(token), top_logprobs=top))
    return p.ChatLogprobs(content=content)
