"""Request spans through OpenTelemetry, exported to an OTLP collector (``--otlp-traces-endpoint``).

Off (every helper returns None, costing one check) until ``init_tracing`` is given an endpoint in a
process: the ingress and each worker replica call it with the engine option of the same name, as
vLLM's ``--otlp-traces-endpoint``. The ingress opens one span per engine request, continuing the
client's trace when its HTTP request carries a W3C ``traceparent``; the span's context travels to
the worker replica inside the ``WorkerRequest`` (``trace_headers``), where the replica's span is its
child and the engine thread adds the request's engine events to it. ``benchmarks/probes/hop_trace.py``
reads these spans to time each hop of the serving path.

The protocol is the standard variable's: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` ``http/protobuf``
(the default; the endpoint is a URL such as ``http://collector:4318/v1/traces``) or ``grpc``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Mapping

from opentelemetry import context, propagate, trace

logger = logging.getLogger(__name__)

TRACER_NAME = "pagefleet"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"

_lock = threading.Lock()
_endpoint: str | None = None  # the endpoint this process exports to, once initialised


def init_tracing(endpoint: str | None, service_name: str, exporter=None) -> None:
    """Export this process's spans to ``endpoint`` (None: tracing stays off), or to ``exporter``
    (an OpenTelemetry ``SpanExporter``; ``endpoint`` then only names it), span by span. Once per
    process: OpenTelemetry takes one tracer provider; a second call with another endpoint raises."""
    global _endpoint
    if not endpoint:
        return
    with _lock:
        if _endpoint is not None:
            if endpoint != _endpoint:
                raise ValueError(f"tracing already exports to {_endpoint!r}, not {endpoint!r}")
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)) if exporter is None
                                    else SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _endpoint = endpoint
    logger.info("tracing: spans of %s go to %s", service_name, endpoint)


def _exporter(endpoint: str):
    protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ValueError(f"{PROTOCOL_ENV} must be http/protobuf or grpc, got {protocol!r}")
    except ImportError as exc:
        raise RuntimeError(f"--otlp-traces-endpoint needs the OTLP exporter for {protocol} "
                           "(pip install 'pagefleet[tracing]')") from exc
    return OTLPSpanExporter(endpoint=endpoint)


def start_span(name: str, headers: Mapping[str, str] | None = None, start_s: float | None = None,
               attributes: Mapping[str, object] | None = None) -> trace.Span | None:
    """A span started at ``start_s`` (time.time(); default now), None while tracing is off. Its
    parent is the span current in this context (the HTTP server's span, where the web framework
    records one), else the trace context in ``headers`` (W3C ``traceparent``), else none."""
    if _endpoint is None:
        return None
    if trace.get_current_span().get_span_context().is_valid:
        parent = context.get_current()
    else:
        parent = propagate.extract(headers) if headers else context.Context()
    start_ns = None if start_s is None else int(start_s * 1e9)
    return trace.get_tracer(TRACER_NAME).start_span(name, context=parent, start_time=start_ns,
                                                   attributes=dict(attributes or {}))


def headers_of(span: trace.Span | None) -> dict[str, str] | None:
    """The W3C trace context of ``span``, to carry to another process (None without a span)."""
    if span is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def event(span: trace.Span | None, name: str, at_s: float | None = None) -> None:
    """Mark ``name`` on ``span`` now (or at ``at_s``, time.time()); nothing without a span."""
    if span is not None:
        span.add_event(name, timestamp=int((time.time() if at_s is None else at_s) * 1e9))


def end(span: trace.Span | None, error: BaseException | None = None) -> None:
    """End ``span`` (nothing without one), marked failed with ``error``'s type and message."""
    if span is not None:
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()
