"""OpenAI-shaped errors: one exception type and the JSON body every 4xx/5xx carries.

Status codes: 400 for bad values, bad types and prompts that do not fit
``max_model_len``, and for well-formed requests that use a feature pagefleet does not implement
(``echo``, ``suffix``, images, vLLM's fields in ``vllm_fields.NOT_IMPLEMENTED``; code
``unsupported``); 401 without the API key; 404 for an unknown model or route;
413 for a body over the size limit; 415 for a body that is not JSON; 429 when admission control turns a request away
(no worker has room and the admission queue is full, or the wait ran out) and
503 when no worker can take the request (draining, a worker that died), both
with ``Retry-After``; 500 for a bug, whose message never carries the
exception's text (file paths, addresses): that goes to the server log under an
error id.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "unsupported_feature_error",
    429: "requests",  # OpenAI's type for a request-rate limit
    503: "service_unavailable_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every 4xx and 5xx (OpenAI's error shape); the OpenAPI schema documents it from here."""

    error: ErrorDetail


class OpenAIError(Exception):
    """A request failure that the client should see as ``{"error": {...}}``."""

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After
        self.type = type or _TYPES.get(status_code, "internal_server_error" if status_code >= 500
                                       else "invalid_request_error")

    def body(self) -> dict:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, status_code=400, param=param, code=code)


def unsupported(message: str, param: str) -> OpenAIError:
    """A well-formed request asking for something pagefleet does not implement (a 400 naming it,
    as vLLM answers what it cannot do)."""
    return OpenAIError(message, status_code=400, param=param, code="unsupported")


def too_many_requests(message: str, retry_after_s: int) -> OpenAIError:
    """The one 429 (admission control's), shaped as OpenAI's own rate-limit error."""
    return OpenAIError(message, status_code=429, code="rate_limit_exceeded", retry_after_s=retry_after_s)


def unavailable(message: str, retry_after_s: int = 1, code: str = "unavailable") -> OpenAIError:
    return OpenAIError(message, status_code=503, code=code, retry_after_s=retry_after_s)


def internal_error(exc: BaseException) -> OpenAIError:
    """A 500 that says nothing about the failure but an id to find it by in the server log."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s", error_id, exc_info=exc)
    return OpenAIError(f"internal server error (error id {error_id}; the details are in the server log)",
                       status_code=500, code="internal_error")


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """The first pydantic error as a 400, naming the offending field in ``param``."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    param = _param_name([part for part in first.get("loc", ()) if part != "body"])
    msg = "field required" if first.get("type") == "missing" else first.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


# Fields inside a message or content part, which OpenAI names with the index in front.
_NESTED_FIELDS = ("role", "content", "name", "text", "type")


def _param_name(loc: list) -> str | None:
    """OpenAI's spelling of a field path ("messages.[1].content"); pydantic's union
    branch names ("list[int]") that follow a field name are dropped."""
    if not loc:
        return None
    parts = [str(loc[0])]
    i = 1
    while i + 1 < len(loc) and isinstance(loc[i], int) and loc[i + 1] in _NESTED_FIELDS:
        parts += [f"[{loc[i]}]", str(loc[i + 1])]
        i += 2
    return ".".join(parts)


def error_response(exc: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error a client can see, including FastAPI's own, gets the OpenAI shape."""

    async def on_openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc))

    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        response = error_response(OpenAIError(message, status_code=exc.status_code))
        response.headers.update(exc.headers or {})  # a 405's Allow, which RFC 9110 requires
        return response

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(internal_error(exc))

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
