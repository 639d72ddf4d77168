"""OpenAI's request and response shapes (the subset vattn serves), as pydantic models.

Requests validate ranges here, so bad input is a 400 naming the field before it reaches the engine; fields
OpenAI defines that vattn does not implement are refused when set to anything but their no-op default.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.tool_calls import forced_structure
from worker.sampling import SamplingParams, StructuredOutputs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, a regex, a choice, a grammar, any JSON object."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(BaseModel):
    """Fields completions and chat share. Unknown fields are ignored, as OpenAI's own server does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1: off (vLLM's -1 is accepted)")
    min_p: float = Field(0.0, ge=0, le=1, description="vLLM's: drop tokens less likely than this share of the likeliest")
    min_tokens: int = Field(0, ge=0, description="vLLM's: no EOS or stop_token_ids before this many tokens")
    stop_token_ids: list[int] | None = Field(None, description="vLLM's: token ids that end the output")
    include_stop_str_in_output: bool = Field(False, description="vLLM's: keep the stop string that ended the text")
    bad_words: list[str] | None = Field(None, description="vLLM's: words the output must not contain")
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="vLLM's: only these token ids may be drawn")
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id -> bias in [-100, 100], added to that token's logit (OpenAI's)")
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(True, description="vLLM's: special tokens (EOS, a template's markers) stay out of the text")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="subtracted from each token's logit once the output has it")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="subtracted per time the output has the token")
    repetition_penalty: float = Field(1.0, gt=0, description="vLLM's: a prompt or output token's positive logit "
                                      "divided by this, a negative one multiplied; 1: off")
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM's: json (a schema), regex, choice, grammar (Lark or GBNF) or json_object")
    cache_salt: str | None = Field(None, min_length=1, description="vLLM's: only requests with the same salt share "
                                   "cached prefixes (tenants that must not see each other's prompts, even by timing)")

    @property
    def structured(self) -> StructuredOutputs | None:
        """What the output must match: ``structured_outputs`` or ``response_format`` (not both)."""
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return StructuredOutputs(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                     json_object=bool(so.json_object))
        f = self.response_format
        if f is None or f.type == "text":
            return None
        return StructuredOutputs(json_object=True) if f.type == "json_object" else StructuredOutputs(json=f.json_schema.schema_)

    @model_validator(mode="after")
    def _one_structure(self):
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format and structured_outputs: set one of them")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters for this request (``max_tokens`` and ``logprobs`` as its endpoint names them);
        a ``ValueError`` for a combination they refuse."""
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(0, self.top_k), min_p=self.min_p, logit_bias=self.logit_bias or (),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, bad_words=self.bad_words or (),
                              allowed_token_ids=self.allowed_token_ids or (),
                              min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids or (),
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              seed=self.seed, n=self.n, stop=self.stops, ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structured,
                              logprobs=logprobs)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="the prompt's text before each completion's (with logprobs: the prompt "
                                         "tokens' too, the first with none)")
    suffix: None = Field(None, description="not implemented")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt, or several (a list of strings or of token-id lists)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @model_validator(mode="after")
    def _prompts_not_empty(self):
        if not self.prompt or any(not p for p in self.prompts):
            raise ValueError("prompt must not be empty")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallMessage(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as the chat template takes it (a call's arguments as an object, as templates expect them)."""
        message = {"role": self.role, "content": self.text(), **({"name": self.name} if self.name else {})}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> dict | str:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: up to the model's context")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_among_tools(self):
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among tools {names}")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.forced_tool is not None and (self.response_format is not None or self.structured_outputs is not None):
            raise ValueError("tool_choice 'required' or a named function shapes the output: no response_format or "
                             "structured_outputs with it")
        return self

    @property
    def forced_tool(self) -> str | None:
        """``"required"``, or the name of the function ``tool_choice`` names; None when the model may answer freely."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    @property
    def structured(self) -> StructuredOutputs | None:
        if (forced := self.forced_tool) is not None:
            return forced_structure([t.model_dump() for t in self.tools], forced, self.parallel_tool_calls)
        return super().structured

    @property
    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# -- responses ---------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallMessage] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in a call's first delta only
    arguments: str = ""  # the next piece of the arguments' JSON text


class ToolCallDelta(BaseModel):
    """A piece of tool call ``index`` (OpenAI's streamed shape): its first piece has its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vattn"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or chat messages put through the model's chat template (with the assistant's
    turn opened, as a chat completion would)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
