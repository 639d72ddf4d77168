"""What every endpoint family of the API shares (vLLM's ``serving_engine``): the server's limits, the API key and
model check, a request's sampling parameters, the engine call under the server's pending-request limit, and the
pieces of a response -- usage, engine failures, server-sent events, streamed text deltas."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from cluster.outputs import RequestOutput
from server import protocol as p
from server.errors import APIError, engine_error
from server.outputs import OutputCollector, Progress
from server.text import TextStream
from worker.sampling import SamplingParams


@dataclass(frozen=True)
class ServerSettings:
    """The API's limits. ``api_keys``: one of them is required as ``Authorization: Bearer ...`` on ``/v1/*``,
    ``/tokenize``, ``/detokenize`` and ``/dashboard`` (none: the API is open)."""

    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    max_tokens: int | None = None  # cap on max_tokens (None: the model's context)
    max_pending: int = 1024  # requests the ingress holds at once; more get 429
    tool_call_parser: str | None = None  # how ``tool_choice: auto`` answers are read (``server.tool_calls.PARSERS``)


def authorize(settings: ServerSettings, request: Request) -> None:
    """A 401 unless the request carries one of the server's keys (where it has any). Each key is compared in constant
    time, and all of them are, so the time taken tells nothing about a guess."""
    if not settings.api_keys:
        return
    given = request.headers.get("authorization", "").encode()
    matches = [hmac.compare_digest(given, f"Bearer {key}".encode()) for key in settings.api_keys]
    if not any(matches):
        raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")


class Pending:
    """Requests the ingress holds now, against the server's limit (one count for every endpoint family)."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0


async def closed(outputs) -> None:
    """Close ``outputs`` (which aborts its requests) even from a cancelled task: Starlette cancels a stream's task
    when its client goes away, and under anyio every await in a cancelled scope would raise at once."""
    with anyio.CancelScope(shield=True):
        await outputs.aclose()


class OpenAIServing:
    """The base of ``ServingCompletions`` and ``ServingChat``."""

    def __init__(self, collector: OutputCollector, settings: ServerSettings, model_name: str, max_model_len: int,
                 pending: Pending):
        self.collector, self.settings = collector, settings
        self.model_name, self.max_model_len = model_name, max_model_len
        self.pending = pending

    def check(self, request: Request, model: str | None = None) -> None:
        """The API key, and ``model`` (where the request names one) is the one this server serves."""
        authorize(self.settings, request)
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "not_found",
                           "model")

    def sampling(self, body: p.SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """``body``'s parameters within this server's limits (``n``, ``max_tokens``: none asked is the most allowed)."""
        if body.n > self.settings.max_n:
            raise APIError(400, f"n={body.n} is over this server's limit of {self.settings.max_n}", param="n")
        cap = self.settings.max_tokens or self.max_model_len
        if max_tokens is not None and max_tokens > cap:
            raise APIError(400, f"max_tokens={max_tokens} is over this server's limit of {cap}", param="max_tokens")
        try:
            return body.to_sampling_params(max_tokens or cap, logprobs)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    async def start(self, prompts: list, params: SamplingParams, stream: bool, chat: list[dict] | None = None,
                    cache_salt: str | None = None, tools: list[dict] | None = None) -> AsyncIterator[Progress]:
        """The engine's output stream, its first item already taken (so bad input is a 400, not a broken stream)."""
        pending = self.pending
        if pending.count >= pending.limit:
            raise APIError(429, f"the server holds {pending.limit} requests already: retry later", "rate_limit_exceeded")
        pending.count += 1
        outputs = self.collector.generate(prompts, params, stream, chat, cache_salt, tools)
        try:
            first = await outputs.__anext__()
        except BaseException as exc:
            pending.count -= 1
            await closed(outputs)
            if isinstance(exc, StopAsyncIteration):
                raise APIError(503, "the engine ended the request without output", "service_unavailable") from None
            raise engine_error(exc) from None

        async def items() -> AsyncIterator[Progress]:
            try:
                for item in first:
                    yield item
                async for batch in outputs:
                    for item in batch:
                        yield item
            except Exception as exc:
                raise engine_error(exc) from None
            finally:
                pending.count -= 1
                await closed(outputs)  # a client gone mid-stream: what still runs is aborted

        return items()

    @staticmethod
    async def finals(items: AsyncIterator[Progress], count: int) -> list[Progress]:
        done: list[Progress | None] = [None] * count
        async for item in items:
            if item.output.finished:
                done[item.index] = item
        return done

    @staticmethod
    def usage(outputs: list[RequestOutput]) -> p.Usage:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    @staticmethod
    def failed(out: RequestOutput) -> None:
        if out.error is not None:  # the engine failed under it (input errors are refused before it runs)
            raise APIError(503, out.error, "service_unavailable")

    # -- streaming -----------------------------------------------------------------------------
    @staticmethod
    def sse(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream")

    @staticmethod
    def event(chunk: p.BaseModel | APIError) -> str:
        """One server-sent event: a chunk (pydantic's own serializer: half the time of model_dump + json.dumps, and a
        non-finite float goes out as null, not json.dumps's -Infinity, which is no JSON), or an error's OpenAI body."""
        data = chunk.response().body.decode() if isinstance(chunk, APIError) else chunk.model_dump_json()
        return f"data: {data}\n\n"

    async def deltas(self, items: AsyncIterator[Progress], stops: tuple[str, ...]):
        """(prompt index, output, completion, new text, its new logprob entries) each time a
        completion gains tokens or ends; an ``APIError`` in place of the text when the engine failed."""
        streams: dict[tuple[int, int], TextStream] = {}
        try:
            async for item in items:
                out = item.output
                for c in out.outputs:
                    s = streams.setdefault((item.index, c.index), TextStream(stops))
                    start = s.tokens
                    text = s.advance(c.text, len(c.token_ids), c.finish_reason is not None)
                    if text is not None:
                        yield item.index, out, c, text, (c.logprobs or ())[start : s.tokens]
                self.failed(out)
        except APIError as exc:
            yield None, None, None, exc, ()
