"""Tool calls: what a chat request's ``tool_choice`` makes the model write, and how the calls are read back out.

As vLLM does: a named function or ``required`` is enforced with a grammar and needs no parser -- a named function's
output is its arguments (a JSON object matching its parameters), ``required``'s a JSON array of ``{"name",
"parameters"}`` calls of the tools given. ``auto`` lets the model choose and reads its calls with the parser the
server was started with (``--tool-call-parser``): ``hermes`` (Hermes, Qwen 2.5: ``<tool_call>{"name", "arguments"}
</tool_call>`` blocks) or ``llama3_json`` (Llama 3.1: a JSON object ``{"name", "parameters"}``, several separated by
``;``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from worker.sampling import StructuredOutputs


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def forced_structure(tools: list[dict], choice: str, parallel: bool = True) -> StructuredOutputs:
    """The grammar of ``tool_choice`` ``required`` (``choice == "required"``: one call, or several when ``parallel``)
    or of the function named ``choice``."""
    compact = {"x-guidance": {"whitespace_flexible": False}}  # llguidance's: no whitespace between JSON tokens
    if choice != "required":
        (function,) = [t["function"] for t in tools if t["function"]["name"] == choice]
        return StructuredOutputs(json={**(function.get("parameters") or {"type": "object"}), **compact})
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    return StructuredOutputs(json={"type": "array", "minItems": 1, "items": {"anyOf": calls},
                                   **({} if parallel else {"maxItems": 1}), **compact})


def forced_calls(text: str, choice: str) -> list[ToolCall]:
    """The calls in a grammar-forced output (``forced_structure``): a named function's arguments, or ``required``'s
    array. An output cut short (``max_tokens``) is no call."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if choice != "required":
        return [ToolCall(choice, text.strip())]  # as streamed: the grammar wrote compact JSON
    return [ToolCall(c["name"], json.dumps(c["parameters"])) for c in value]


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the text around them is the content."""

    START = "<tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for body in self.BLOCK.findall(text):
            try:
                call = json.loads(body)
                calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}))))
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []  # a malformed block: the whole text is content, as vLLM's parser gives it
        if not calls:
            return text, []
        content = self.BLOCK.sub("", text).strip()
        return content or None, calls

    def held_from(self, text: str) -> int:
        """Where a streamed text must stop being sent as content: the first call's start, or a prefix of it at the end."""
        if (at := text.find(self.START)) >= 0:
            return at
        for k in range(len(self.START) - 1, 0, -1):
            if text.endswith(self.START[:k]):
                return len(text) - k
        return len(text)


class Llama3JsonParser:
    """A JSON object ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), the whole output; anything
    else is content."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        stripped = text.strip().removeprefix("<|python_tag|>")
        if not stripped.startswith("{"):
            return text, []
        calls = []
        try:
            for part in stripped.split(";"):
                call = json.loads(part)
                calls.append(ToolCall(call["name"], json.dumps(call.get("parameters", call.get("arguments", {})))))
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
        return None, calls

    def held_from(self, text: str) -> int:
        return 0 if text.lstrip().startswith(("{", "<|python_tag|>")) or not text.strip() else len(text)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


@dataclass(frozen=True)
class CallPiece:
    """A piece of streamed tool call ``index``: ``call`` (its id and name) with its first piece only."""

    index: int
    arguments: str
    call: ToolCall | None = None


class CallStream:
    """One streamed choice's tool calls as the text grows, in OpenAI's pieces: a named function's arguments as the
    grammar writes them; ``required``'s calls each once its array element is complete; a parser's (``auto``) each
    once its block is (``HermesParser``), or at the end (``Llama3JsonParser``). ``content`` says how much of the text
    may go out as content meanwhile."""

    def __init__(self, forced: str | None, parser: HermesParser | Llama3JsonParser | None):
        self.forced, self.parser = forced, parser
        self.calls: list[ToolCall] = []  # those begun
        self._sent = 0  # characters of a named function's arguments sent

    def content(self, text: str) -> int:
        """Characters of ``text`` that are content whatever follows (none under a grammar-forced call)."""
        return 0 if self.parser is None else self.parser.held_from(text)

    def pieces(self, text: str, finished: bool) -> list[CallPiece]:
        """What ``text`` adds to the calls sent so far."""
        if self.forced not in (None, "required"):
            piece, self._sent = text[self._sent:], len(text)
            if not self.calls:
                self.calls.append(ToolCall(self.forced, ""))
                return [CallPiece(0, piece, self.calls[0])]
            return [CallPiece(0, piece)] if piece else []
        if self.forced == "required":
            found = [ToolCall(e["name"], json.dumps(e["parameters"])) for e in _complete_elements(text)]
        elif isinstance(self.parser, HermesParser) or finished:
            found = self.parser.parse(text)[1]
        else:
            found = []
        new = found[len(self.calls):]
        self.calls += new
        return [CallPiece(len(self.calls) - len(new) + k, c.arguments, c) for k, c in enumerate(new)]


def _complete_elements(text: str) -> list:
    """The values of a JSON array's elements that ``text`` (the array, maybe cut short) holds whole."""
    depth, in_string, escaped, start, done = 0, False, False, None, []
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth == 2:
                start = i
        elif ch in "]}":
            depth -= 1
            if depth == 1 and start is not None:
                done.append(json.loads(text[start:i + 1]))
                start = None
    return done
