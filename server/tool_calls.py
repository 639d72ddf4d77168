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
        return [ToolCall(choice, json.dumps(value))]
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
