"""The FastAPI app of the OpenAI API: routes, auth, body parsing, SSE responses.

Built around an ``OpenAIService`` so the same app runs under ``@serve.ingress``
in production and under a test client with a fake worker in tests.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.openai import responses_api
from pagefleet.router.openai.auth import APIKeyMiddleware
from pagefleet.router.openai.errors import OpenAIError, from_validation_error, install_error_handlers
from pagefleet.router.openai.http_guards import (
    INLINE_PARSE_BYTES,
    BodyLimits,
    check_content_type,
    client_address,
    parse_json_object,
    read_body,
)
from pagefleet.router.openai.lora_adapters import RuntimeLoRAs, add_lora_routes
from pagefleet.router.openai.node_metrics import NodeMetricsReader
from pagefleet.router.openai.openapi_spec import install_schemas, route_docs
from pagefleet.router.openai.output import response_schema as out
from pagefleet.router.openai.output.response_events import ResponseShaper
from pagefleet.router.openai.output.responses import json_body
from pagefleet.router.openai.output.sse import sse_stream, sse_typed_stream
from pagefleet.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from pagefleet.router.openai.service import OpenAIService, PreparedRequest

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
PARSE_THREADS = 2
HEALTH_TIMEOUT_S = 5.0
PRIORITY_HEADER = "X-Vllm-Priority"
# /tokenize answers with up to this many token ids encoded on the event loop.
INLINE_ENCODE_TOKENS = 4096

Body = TypeVar("Body", bound=BaseModel)


# Routes counted by name in pagefleet_http_requests; anything else counts as "other".
ROUTES = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                    "/detokenize", "/health", "/version", "/metrics", "/v1/load_lora_adapter",
                    "/v1/unload_lora_adapter"})


class ResponseCounter:
    """Counts every response by route and status code (``pagefleet_http_requests``) as it starts.

    Plain ASGI, like the API-key check: a streamed body's chunks go straight through. (Starlette's
    ``@app.middleware("http")`` would pass each chunk through a memory stream and a task of its
    own: per token, per stream.)"""

    def __init__(self, app: ASGIApp, *, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = Request(scope).url.path
        route = path if path in ROUTES else "other"
        started = False

        async def send_counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.inc("http_requests", route=route, status_code=str(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            if not started:
                self.metrics.inc("http_requests", route=route, status_code="500")
            raise


def build_openai_app(service: OpenAIService, *, api_key: str | None = None, body_limits: BodyLimits = BodyLimits(),
                     metrics: RouterMetrics | None = None, node_metrics: NodeMetricsReader | None = None,
                     runtime_loras: RuntimeLoRAs | None = None) -> FastAPI:
    """``metrics`` counts every response by route and status code; ``node_metrics`` adds this
    node's pagefleet series (from Ray's metrics agent) to ``GET /metrics``; ``runtime_loras``
    serves /v1/load_lora_adapter and /v1/unload_lora_adapter (None: those routes do not exist)."""
    app = FastAPI(title="pagefleet", version=VERSION)
    # Threads of their own: big bodies queue behind each other, never behind /health or /metrics.
    parsers = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="pagefleet-parse")
    install_error_handlers(app)
    keyed = bool(api_key)
    install_schemas(app, service.info, api_key=keyed)
    # What each route can answer besides 200 (and 401 when a key is set).
    generating = (400, 404, 413, 415, 429, 500, 503)
    reading = (400, 404, 413, 415, 500)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, routes_of=app)

    if metrics is not None:  # added after the API-key check, so it wraps it: a 401 is counted too
        app.add_middleware(ResponseCounter, metrics=metrics)
        # What the dashboard plots (requests by status, 429s) exists from the first scrape.
        metrics.start_at_zero("http_requests", *({"route": route, "status_code": status}
                                                 for route in ("/v1/completions", "/v1/chat/completions")
                                                 for status in ("200", "429")))

    async def _parse(request: Request, model: type[Body]) -> Body:
        check_content_type(request)
        raw = await read_body(request, body_limits.max_body_bytes)
        if len(raw) > INLINE_PARSE_BYTES:  # a big body parses off the event loop, on the parsing threads
            return await asyncio.get_running_loop().run_in_executor(parsers, _decode, raw, model)
        return _decode(raw, model)

    @app.get("/v1/models", **route_docs(ok=out.ModelList, api_key=keyed))
    async def list_models() -> dict:
        return service.models()

    async def admit(prepared: PreparedRequest, request: Request, started: float) -> None:
        service.trace(prepared, request.headers, started)
        client = client_address(request.client.host if request.client is not None else "", request.headers)
        for job in prepared.jobs:  # whose share of a worker's grammar compile queue it takes
            job.client = client
        await service.admit(prepared)

    async def respond(prepared: PreparedRequest, request: Request, started: float) -> Response:
        await admit(prepared, request, started)
        if prepared.stream:
            return _event_stream(service.stream_chunks(prepared))
        return Response(await service.run_to_completion_json(prepared), media_type="application/json")

    # Under overload a refusal must cost next to nothing: check_open answers 429 (or 503 while
    # draining) before the body is read, parsed or tokenized.
    @app.post("/v1/completions", **route_docs(request=CompletionRequest, ok=out.CompletionResponse,
                                              chunk=out.CompletionResponse,
                                              errors=generating, api_key=keyed))
    async def create_completion(request: Request) -> Response:
        started = time.time()
        service.check_open()
        body = _priority_from_header(await _parse(request, CompletionRequest), request)
        return await respond(await service.completion(body), request, started)

    @app.post("/v1/chat/completions", **route_docs(request=ChatCompletionRequest, ok=out.ChatCompletionResponse,
                                                   chunk=out.ChatCompletionChunk, errors=generating, api_key=keyed))
    async def create_chat_completion(request: Request) -> Response:
        started = time.time()
        service.check_open()
        body = _priority_from_header(await _parse(request, ChatCompletionRequest), request)
        return await respond(await service.chat(body), request, started)

    @app.post("/v1/responses", **route_docs(request=ResponsesRequest, ok=out.ResponseObject,
                                            events=out.ResponseStreamEvent, errors=generating, api_key=keyed))
    async def create_response(request: Request) -> Response:
        started = time.time()
        service.check_open()
        body = await _parse(request, ResponsesRequest)
        chat = _priority_from_header(responses_api.chat_request(body), request)
        try:
            prepared = await service.chat(chat)
        except OpenAIError as exc:
            raise responses_api.renamed(exc) from None
        shaper = ResponseShaper(model=service.info.served_model_name, echo=responses_api.echo(body))
        await admit(prepared, request, started)
        if prepared.stream:
            return StreamingResponse(sse_typed_stream(shaper.events(service.stream_chunks(prepared))),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        # Built off the loop when big; encoded here: with no logprobs it is a few strings, whatever its length.
        return Response(json_body(shaper.response(await service.run_to_completion(prepared))),
                        media_type="application/json")

    @app.post("/tokenize", **route_docs(request=TokenizeRequest, ok=out.TokenizeResponse, errors=reading,
                                        api_key=keyed))
    async def tokenize(request: Request) -> Response:
        out = await service.tokenize(await _parse(request, TokenizeRequest))
        # as long as the prompt: encoded on the parsing threads when long, as a long body is read
        if out["count"] > INLINE_ENCODE_TOKENS:
            body = await asyncio.get_running_loop().run_in_executor(parsers, json_body, out)
        else:
            body = json_body(out)
        return Response(body, media_type="application/json")

    @app.post("/detokenize", **route_docs(request=DetokenizeRequest, ok=out.DetokenizeResponse, errors=reading,
                                          api_key=keyed))
    async def detokenize(request: Request) -> dict:
        return await service.detokenize(await _parse(request, DetokenizeRequest))

    if runtime_loras is not None:
        add_lora_routes(app, service, runtime_loras,
                        route_docs(ok_media="text/plain", errors=(400, 404, 413, 415, 500, 503), api_key=keyed))

    @app.get("/health", **route_docs(ok_media=None, errors=(503,)))
    async def health() -> Response:
        if service.draining:
            return JSONResponse(OpenAIError("the server is shutting down", status_code=503, code="draining").body(),
                                status_code=503)
        try:
            await asyncio.wait_for(service.client.check_health(), HEALTH_TIMEOUT_S)
        except Exception as exc:  # a timeout, an unhealthy engine or no replica at all
            logger.warning("health check failed: %s: %s", type(exc).__name__, exc)
            return JSONResponse(OpenAIError("no healthy worker replica", status_code=503).body(), status_code=503)
        return Response(status_code=200)

    @app.get("/version", **route_docs(ok=out.VersionResponse))
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics", **route_docs(ok_media="text/plain", errors=(500,)))
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        text = generate_latest(REGISTRY).decode()
        if node_metrics is not None:
            text += await node_metrics.read()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


def freeze_loaded_objects() -> None:
    """For a process that serves the app, once it is built: what exists now (libraries, tokenizer,
    app) lives as long as the process, so the garbage collector stops walking it (``gc.freeze``).
    A full collection walks every object it tracks holding the GIL, whatever thread set it off: over
    all that it would stall the event loop each time a big request's allocations start one."""
    gc.collect()
    gc.freeze()


def _decode(raw: bytes, model: type[Body]) -> Body:
    try:
        return model.model_validate(parse_json_object(raw))
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _priority_from_header(body: Body, request: Request) -> Body:
    """vLLM's ``X-Vllm-Priority`` header: when it holds an integer it replaces the body's
    ``priority`` (one that does not is ignored, as vLLM ignores it)."""
    value = request.headers.get(PRIORITY_HEADER)
    if value is not None:
        try:
            body.priority = int(value)
        except ValueError:
            pass
    return body


def _event_stream(chunks: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(sse_stream(chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
