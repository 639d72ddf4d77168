"""The OpenAI-compatible HTTP API: a FastAPI app served by the ingress deployment, which sends each request
to an engine replica (``server.engine.EngineServer``), collects its outputs (``server.outputs``) and shapes
them as OpenAI does. The routes are a thin layer: each endpoint family is a class over ``server.serving``
(``server.serving_completions``, ``server.serving_chat``), as vLLM's serving layer is split.

Errors are OpenAI's JSON (``server.errors.APIError``): 400 for bad input (bad JSON included), 401 without the API
key, 404 for an unknown model, 413 for a body over the limit, 429 when the ingress holds as many requests as it may,
503 while the engine is down or rebuilding.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from server import protocol as p
from server.dashboard import CSP as DASHBOARD_CSP
from server.dashboard import MemoryHistory
from server.dashboard import render as render_dashboard
from server.engine import scheduler_actors
from server.errors import APIError
from server.metrics import CONTENT_TYPE, render
from server.outputs import OutputCollector
from server.serving import Pending, ServerSettings, authorize
from server.serving_chat import ServingChat
from server.serving_completions import ServingCompletions
from server.serving_tokenization import ServingTokenization

try:
    VERSION = version("vattn")
except PackageNotFoundError:  # run from a checkout without installing
    VERSION = "0+unknown"

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


def _validation_error(exc: RequestValidationError) -> APIError:
    def place(error: dict) -> str:
        return ".".join(str(x) for x in error.get("loc", ()) if x != "body")

    errors = exc.errors()
    message = "; ".join(f"{place(e)}: {e.get('msg')}" if place(e) else str(e.get("msg")) for e in errors)
    if any(e.get("type") == "json_invalid" for e in errors):
        message = f"the body is not valid JSON: {message}"
    return APIError(400, message or "invalid request", param=(place(errors[0]) or None) if errors else None)


async def ask_replicas(method: str, fallback) -> dict:
    """``method``'s answer from every engine replica's scheduler actor, ``fallback`` where none came in 5 s."""
    async def ask(actor):
        try:
            return await asyncio.wait_for(getattr(actor, method).remote(), timeout=5)
        except Exception:  # a replica going away or rebuilding
            return fallback

    actors = await asyncio.to_thread(scheduler_actors)  # GCS calls: the event loop serves the streams meanwhile
    return dict(zip(actors, await asyncio.gather(*(ask(a) for a in actors.values())), strict=True))


def build_api(collector: OutputCollector, settings: ServerSettings, model_name: str, max_model_len: int,
              num_replicas: int = 1) -> FastAPI:
    """The FastAPI app over the engine deployment ``collector`` sends to (``num_replicas`` engine replicas)."""
    app = FastAPI(title="vattn", version=VERSION)
    pending = Pending(settings.max_pending)
    completions = ServingCompletions(collector, settings, model_name, max_model_len, pending)
    chats = ServingChat(collector, settings, model_name, max_model_len, pending)
    tokenization = ServingTokenization(collector, settings, model_name, max_model_len, pending)
    history = MemoryHistory()

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.get("/health")
    async def health():
        """200 while at least one engine replica serves ("degraded" unless all do, replicas being replaced aside),
        else 503."""
        states = await ask_replicas("health", "unreachable")
        draining = sum(state == "draining" for state in states.values())  # a rolling update's old replicas
        states |= {f"missing-{k}": "missing" for k in range(num_replicas - len(states) + draining)}
        ready = sum(state == "ok" for state in states.values())
        if not ready:
            detail = ", ".join(f"{replica}: {state}" for replica, state in states.items())
            raise APIError(503, f"no engine replica is serving ({detail})", "service_unavailable")
        return {"status": "ok" if ready + draining == len(states) else "degraded", "replicas": states}

    @app.get("/metrics")
    async def metrics():
        snapshots = await ask_replicas("snapshot", None)  # a replica without one: its series return with it
        return Response(render({(model_name, r): s for r, s in snapshots.items() if s is not None}), media_type=CONTENT_TYPE)

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard(request: Request):
        """A live page of the KV memory (``server.dashboard``), behind the API key: it shows the load."""
        authorize(settings, request)
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
        completions.check(request)
        return p.ModelList(data=[p.ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.post("/v1/completions", response_model=p.CompletionResponse)
    async def create_completion(body: p.CompletionRequest, request: Request):
        return await completions.create(body, request)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse)
    async def create_chat_completion(body: p.ChatCompletionRequest, request: Request):
        return await chats.create(body, request)

    @app.post("/tokenize", response_model=p.TokenizeResponse)
    async def tokenize(body: p.TokenizeRequest, request: Request):
        return await tokenization.tokenize(body, request)

    @app.post("/detokenize", response_model=p.DetokenizeResponse)
    async def detokenize(body: p.DetokenizeRequest, request: Request):
        return await tokenization.detokenize(body, request)

    return app
