"""The FastAPI app of the OpenAI API: routes, auth, body parsing, SSE responses.

Built around an ``OpenAIService`` so the same app runs under ``@serve.ingress``
in production and under a test client with a fake worker in tests.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, AsyncIterator, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from pagefleet.router.errors import OpenAIError, bad_request, from_validation_error, install_error_handlers
from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.node_metrics import NodeMetricsReader
from pagefleet.router.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagefleet.router.service import OpenAIService, PreparedRequest
from pagefleet.router.sse import sse_stream

VERSION = "0.1.0"
HEALTH_TIMEOUT_S = 5.0

Body = TypeVar("Body", bound=BaseModel)


# Routes counted by name in pagefleet_http_requests; anything else counts as "other".
ROUTES = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                    "/health", "/version", "/metrics"})


def build_openai_app(service: OpenAIService, *, api_key: str | None = None, metrics: RouterMetrics | None = None,
                     node_metrics: NodeMetricsReader | None = None) -> FastAPI:
    """``metrics`` counts every response by route and status code; ``node_metrics`` adds this
    node's pagefleet series (from Ray's metrics agent) to ``GET /metrics``."""
    app = FastAPI(title="pagefleet", version=VERSION)
    install_error_handlers(app)

    if api_key:
        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            # Like vLLM: the key guards the OpenAI routes; probes (/health, /metrics) stay open.
            if request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "")
                if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    return JSONResponse(OpenAIError("invalid or missing API key", status_code=401,
                                                    code="invalid_api_key").body(), status_code=401)
            return await call_next(request)

    if metrics is not None:
        # Added after the API-key check, so it wraps it: a 401 is counted too.
        @app.middleware("http")
        async def count_requests(request: Request, call_next):
            route = request.url.path if request.url.path in ROUTES else "other"
            try:
                response = await call_next(request)
            except Exception:
                metrics.inc("http_requests", route=route, status_code="500")
                raise
            metrics.inc("http_requests", route=route, status_code=str(response.status_code))
            return response

    @app.get("/v1/models")
    async def list_models() -> dict:
        return service.models()

    async def respond(prepared: PreparedRequest) -> Response:
        await service.admit(prepared)
        if prepared.stream:
            return _event_stream(service.stream_chunks(prepared))
        return JSONResponse(await service.run_to_completion(prepared))

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await respond(service.completion(await _parse(request, CompletionRequest)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await respond(service.chat(await _parse(request, ChatCompletionRequest)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return service.tokenize(await _parse(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return service.detokenize(await _parse(request, DetokenizeRequest))

    @app.get("/health")
    async def health() -> Response:
        try:
            await asyncio.wait_for(service.client.check_health(), HEALTH_TIMEOUT_S)
        except Exception as exc:  # a timeout, an unhealthy engine or no replica at all
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return JSONResponse(OpenAIError(f"no healthy worker ({detail})", status_code=503).body(),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        text = generate_latest(REGISTRY).decode()
        if node_metrics is not None:
            text += await node_metrics.read()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


async def _parse(request: Request, model: type[Body]) -> Body:
    raw = await request.body()
    try:
        data: Any = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"could not parse the JSON body of the request: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which JSON (and OpenAI) do not.
    raise ValueError(f"{name} is not valid JSON")


def _event_stream(chunks: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(sse_stream(chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
