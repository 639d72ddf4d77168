"""The OpenAI-compatible HTTP API: a FastAPI app served by the ingress deployment, which sends each request
to an engine replica (``server.engine.EngineServer``), collects its outputs (``server.outputs``) and shapes
them as OpenAI does.

Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for bad input (bad JSON
included), 401 without the API key, 404 for an unknown model, 413 for a body over the limit, 429 when the
ingress holds as many requests as it may, 503 while the engine is down or rebuilding.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.errors import EngineDeadError
from cluster.outputs import RequestOutput
from server import protocol as p
from server.dashboard import CSP as DASHBOARD_CSP
from server.dashboard import MemoryHistory
from server.dashboard import render as render_dashboard
from server.engine import scheduler_actors
from server.metrics import CONTENT_TYPE, render
from server.outputs import OutputCollector, Progress
from server.text import TextStream, chat_logprobs, completion_logprobs
from worker.sampling import SamplingParams

try:
    VERSION = version("vattn")
except PackageNotFoundError:  # run from a checkout without installing
    VERSION = "0+unknown"


@dataclass(frozen=True)
class ServerSettings:
    """The API's limits. ``api_key``: required as ``Authorization: Bearer ...`` on ``/v1/*`` when set."""

    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    max_tokens: int | None = None  # cap on max_tokens (None: the model's context)
    max_pending: int = 1024  # requests the ingress holds at once; more get 429


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        body = p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=self.kind, param=self.param, code=self.status))
        return JSONResponse(body.model_dump(), status_code=self.status)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before it is read whole."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def counting() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise APIError(413, f"request body over {self.limit} bytes")
            return message

        try:
            await self.app(scope, counting, send)
        except APIError:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await APIError(413, f"request body over {self.limit} bytes").response()(scope, receive, send)


async def closed(outputs) -> None:
    """Close ``outputs`` (which aborts its requests) even from a cancelled task: Starlette cancels a stream's task
    when its client goes away, and under anyio every await in a cancelled scope would raise at once."""
    with anyio.CancelScope(shield=True):
        await outputs.aclose()


def _cause(exc: BaseException) -> BaseException:
    """The replica's own exception behind Ray's wrapper."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _engine_error(exc: BaseException) -> APIError:
    exc = _cause(exc)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable")
    return APIError(503, f"the engine failed: {type(exc).__name__}: {exc}", "service_unavailable")


def build_api(collector: OutputCollector, settings: ServerSettings, model_name: str, max_model_len: int,
              num_replicas: int = 1) -> FastAPI:
    """The FastAPI app over the engine deployment ``collector`` sends to (``num_replicas`` engine replicas)."""
    app = FastAPI(title="vattn", version=VERSION)
    pending = 0

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        def place(error: dict) -> str:
            return ".".join(str(x) for x in error.get("loc", ()) if x != "body")

        errors = exc.errors()
        message = "; ".join(f"{place(e)}: {e.get('msg')}" if place(e) else str(e.get("msg")) for e in errors)
        if any(e.get("type") == "json_invalid" for e in errors):
            message = f"the body is not valid JSON: {message}"
        return APIError(400, message or "invalid request", param=(place(errors[0]) or None) if errors else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "invalid_request_error").response()

    def check(request: Request, model: str | None = None) -> None:
        if settings.api_key is not None and request.headers.get("authorization") != f"Bearer {settings.api_key}":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        if model is not None and model != model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {model_name!r}", "not_found", "model")

    def sampling(body: p.SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if body.n > settings.max_n:
            raise APIError(400, f"n={body.n} is over this server's limit of {settings.max_n}", param="n")
        cap = settings.max_tokens or max_model_len
        if max_tokens is not None and max_tokens > cap:
            raise APIError(400, f"max_tokens={max_tokens} is over this server's limit of {cap}", param="max_tokens")
        try:
            return SamplingParams(max_tokens=max_tokens or cap, temperature=body.temperature, top_p=body.top_p,
                                  top_k=max(0, body.top_k), seed=body.seed, n=body.n, stop=body.stops,
                                  ignore_eos=body.ignore_eos, logprobs=logprobs)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    async def start(prompts: list, params: SamplingParams, stream: bool, chat: list[dict] | None = None,
                    cache_salt: str | None = None):
        """The engine's output stream, its first item already taken (so bad input is a 400, not a broken stream)."""
        nonlocal pending
        if pending >= settings.max_pending:
            raise APIError(429, f"the server holds {settings.max_pending} requests already: retry later", "rate_limit_exceeded")
        pending += 1
        outputs = collector.generate(prompts, params, stream, chat, cache_salt)
        try:
            first = await outputs.__anext__()
        except BaseException as exc:
            pending -= 1
            await closed(outputs)
            if isinstance(exc, StopAsyncIteration):
                raise APIError(503, "the engine ended the request without output", "service_unavailable") from None
            raise _engine_error(exc) from None

        async def items() -> AsyncIterator[Progress]:
            nonlocal pending
            try:
                for item in first:
                    yield item
                async for batch in outputs:
                    for item in batch:
                        yield item
            except Exception as exc:
                raise _engine_error(exc) from None
            finally:
                pending -= 1
                await closed(outputs)  # a client gone mid-stream: what still runs is aborted

        return items()

    async def finals(items: AsyncIterator[Progress], count: int) -> list[Progress]:
        done: list[Progress | None] = [None] * count
        async for item in items:
            if item.output.finished:
                done[item.index] = item
        return done

    def usage(outputs: list[RequestOutput]) -> p.Usage:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def failed(out: RequestOutput) -> None:
        if out.error is not None:  # the engine failed under it (input errors are refused before it runs)
            raise APIError(503, out.error, "service_unavailable")

    # -- routes --------------------------------------------------------------------------------
    async def ask_replicas(method: str, fallback):
        """``method``'s answer from every engine replica's scheduler actor, ``fallback`` where none came in 5 s."""
        async def ask(actor):
            try:
                return await asyncio.wait_for(getattr(actor, method).remote(), timeout=5)
            except Exception:  # a replica going away or rebuilding
                return fallback

        actors = scheduler_actors()
        return dict(zip(actors, await asyncio.gather(*(ask(a) for a in actors.values())), strict=True))

    @app.get("/health")
    async def health():
        """200 while at least one engine replica serves ("degraded" unless all do), else 503."""
        states = await ask_replicas("health", "unreachable")
        states |= {f"missing-{k}": "missing" for k in range(num_replicas - len(states))}
        ready = sum(state == "ok" for state in states.values())
        if not ready:
            detail = ", ".join(f"{replica}: {state}" for replica, state in states.items())
            raise APIError(503, f"no engine replica is serving ({detail})", "service_unavailable")
        return {"status": "ok" if ready == len(states) else "degraded", "replicas": states}

    @app.get("/metrics")
    async def metrics():
        snapshots = await ask_replicas("snapshot", None)  # a replica without one: its series return with it
        return Response(render({(model_name, r): s for r, s in snapshots.items() if s is not None}), media_type=CONTENT_TYPE)

    history = MemoryHistory()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        """A live page of the KV memory (``server.dashboard``); no API key, like /metrics."""
        snapshots, maps = await asyncio.gather(ask_replicas("snapshot", None), ask_replicas("page_maps", None))
        snapshots = {r: s for r, s in snapshots.items() if s is not None}
        maps = {r: m for r, m in maps.items() if m is not None}
        history.add(snapshots)
        page = render_dashboard(model_name, snapshots, maps, history)
        return HTMLResponse(page, headers={"Content-Security-Policy": DASHBOARD_CSP, "Cache-Control": "no-store"})

    @app.get("/version")
    async def get_version():
        return {"version": VERSION}

    @app.get("/v1/models", response_model=p.ModelList)
    async def models(request: Request):
        check(request)
        return p.ModelList(data=[p.ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.post("/v1/completions", response_model=p.CompletionResponse)
    async def completions(body: p.CompletionRequest, request: Request):
        check(request, body.model)
        params = sampling(body, body.max_tokens, body.logprobs)
        prompts = body.prompts
        items = await start(prompts, params, body.stream, cache_salt=body.cache_salt)
        rid = p.new_id("cmpl")
        if body.stream:
            return sse(stream_completion(items, rid, body, len(prompts)))
        done = await finals(items, len(prompts))
        for item in done:
            failed(item.output)
        choices = [p.CompletionChoice(index=item.index * body.n + c.index, text=c.text, finish_reason=c.finish_reason,
                                      logprobs=completion_logprobs(c.logprobs or (), c.token_texts or {}) if body.logprobs is not None else None)
                   for item in done for c in item.output.outputs]
        return p.CompletionResponse(id=rid, model=model_name, choices=choices, usage=usage([i.output for i in done]))

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse)
    async def chat(body: p.ChatCompletionRequest, request: Request):
        check(request, body.model)
        params = sampling(body, body.output_limit, (body.top_logprobs or 0) if body.logprobs else None)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in body.messages]
        items = await start([], params, body.stream, messages, body.cache_salt)
        rid = p.new_id("chatcmpl")
        if body.stream:
            return sse(stream_chat(items, rid, body))
        (item,) = await finals(items, 1)
        failed(item.output)
        choices = [p.ChatChoice(index=c.index, message=p.AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                                logprobs=chat_logprobs(c.logprobs or (), c.token_texts or {}) if body.logprobs else None)
                   for c in item.output.outputs]
        return p.ChatCompletionResponse(id=rid, model=model_name, choices=choices, usage=usage([item.output]))

    # -- streaming -----------------------------------------------------------------------------
    def sse(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream")

    def event(model: p.BaseModel | dict) -> str:
        data = model if isinstance(model, dict) else model.model_dump(exclude_none=False)
        return f"data: {json.dumps(data)}\n\n"

    async def deltas(items: AsyncIterator[Progress], stops: tuple[str, ...]):
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
                failed(out)
        except APIError as exc:
            yield None, None, None, exc, ()

    async def stream_completion(items, rid: str, body: p.CompletionRequest, count: int):
        finished: list[RequestOutput | None] = [None] * count
        offsets: dict[tuple[int, int], int] = {}  # where each completion's next logprob token starts in its text
        async for index, out, c, text, entries in deltas(items, body.stops):
            if isinstance(text, APIError):
                yield event(json.loads(text.response().body))
                break
            if out.finished:
                finished[index] = out
            logprobs = None
            if body.logprobs is not None:
                start = offsets.get((index, c.index), 0)
                logprobs = completion_logprobs(entries, c.token_texts or {}, start)
                offsets[index, c.index] = start + sum(map(len, logprobs.tokens))
            choice = p.CompletionChoice(index=index * body.n + c.index, text=text, finish_reason=c.finish_reason,
                                        logprobs=logprobs)
            yield event(p.CompletionResponse(id=rid, model=model_name, choices=[choice]))
        else:
            if body.stream_options and body.stream_options.include_usage:
                yield event(p.CompletionResponse(id=rid, model=model_name, choices=[],
                                                 usage=usage([o for o in finished if o is not None])))
        yield "data: [DONE]\n\n"

    async def stream_chat(items, rid: str, body: p.ChatCompletionRequest):
        final = None
        yield event(p.ChatCompletionChunk(id=rid, model=model_name, choices=[
            p.ChatChunkChoice(index=k, delta=p.Delta(role="assistant", content="")) for k in range(body.n)]))
        async for _, out, c, text, entries in deltas(items, body.stops):
            if isinstance(text, APIError):
                yield event(json.loads(text.response().body))
                break
            final = out if out.finished else final
            choice = p.ChatChunkChoice(index=c.index, delta=p.Delta(content=text or None), finish_reason=c.finish_reason,
                                       logprobs=chat_logprobs(entries, c.token_texts or {}) if body.logprobs else None)
            yield event(p.ChatCompletionChunk(id=rid, model=model_name, choices=[choice]))
        else:
            if body.stream_options and body.stream_options.include_usage and final is not None:
                yield event(p.ChatCompletionChunk(id=rid, model=model_name, choices=[], usage=usage([final])))
        yield "data: [DONE]\n\n"

    return app
