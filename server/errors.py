"""The API's one error type, shaped as OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``), and what
an engine failure becomes."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from cluster.errors import EngineDeadError
from server import protocol as p


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        body = p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=self.kind, param=self.param, code=self.status))
        return JSONResponse(body.model_dump(), status_code=self.status)


def engine_error(exc: BaseException) -> APIError:
    """A 400 for the engine's ``ValueError`` (bad input it found), a 503 for anything else."""
    cause = getattr(exc, "cause", None)  # the replica's own exception behind Ray's wrapper
    exc = cause if isinstance(cause, BaseException) else exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable")
    return APIError(503, f"the engine failed: {type(exc).__name__}: {exc}", "service_unavailable")
