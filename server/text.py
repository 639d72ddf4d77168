"""Text for the API: streamed deltas that never take back what they sent, and OpenAI's logprob shapes."""

from __future__ import annotations

from cluster.outputs import CompletionOutput
from server import protocol as p


class TextStream:
    """One completion's text as it grows. The engine's text so far can still change at its end: a byte
    sequence not yet a whole character decodes as U+FFFD, and the start of a stop string is cut once the
    rest of it arrives. So a delta holds those back until they settle or the completion ends."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.sent = ""
        self.ended = False

    def advance(self, text: str, finished: bool) -> str | None:
        """The new text to send, "" to send only the end, or None when there is nothing to send."""
        if self.ended:
            return None
        if not finished:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._stop_prefix(text)]
        if not text.startswith(self.sent):  # cannot happen given the hold-back; never resend
            return None
        delta = text[len(self.sent) :]
        self.sent += delta
        self.ended = finished
        return delta if delta or finished else None

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
                   default=0)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def completion_logprobs(c: CompletionOutput, texts: dict[int, str]) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs()
    offset = 0
    for t in c.logprobs or ():
        token = texts.get(t.token_id, "")
        out.tokens.append(token)
        out.token_logprobs.append(t.logprob)
        out.top_logprobs.append({texts.get(i, ""): lp for i, lp in (t.top_logprobs or {}).items()} or None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(c: CompletionOutput, texts: dict[int, str]) -> p.ChatLogprobs:
    content = []
    for t in c.logprobs or ():
        token = texts.get(t.token_id, "")
        top = [p.TopLogprob(token=texts.get(i, ""), logprob=lp, bytes=_bytes(texts.get(i, "")))
               for i, lp in (t.top_logprobs or {}).items()]
        content.append(p.TokenLogprob(token=token, logprob=t.logprob, bytes=_bytes(token), top_logprobs=top))
    return p.ChatLogprobs(content=content)
