"""benchmarks/probes/hop_trace.py's OTLP receiver: spans a real OTLP/HTTP exporter sends become hops."""

from __future__ import annotations

import sys
from pathlib import Path

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))
from hop_trace import SPAN_HOPS, SpanReceiver  # noqa: E402


def test_the_receiver_turns_exported_spans_into_each_requests_hops():
    receiver = SpanReceiver()
    provider = TracerProvider()  # a provider of its own: the process's global one is not touched
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint)))
    tracer = provider.get_tracer("test")
    t0 = 1_700_000_000_000_000_000
    ingress = tracer.start_span("pagefleet.request", start_time=t0)
    for k, name in enumerate(("prepared", "routed", "sent")):
        ingress.add_event(name, timestamp=t0 + (k + 1) * 1_000_000)
    worker = tracer.start_span("pagefleet.worker.generate", context=trace.set_span_in_context(ingress),
                               start_time=t0 + 4_000_000)
    for k, name in enumerate(("engine_added", "engine_first_token", "engine_finished")):
        worker.add_event(name, timestamp=t0 + (k + 5) * 1_000_000)
    worker.end(end_time=t0 + 9_000_000)
    ingress.add_event("first_delta", timestamp=t0 + 10_000_000)
    ingress.end(end_time=t0 + 11_000_000)
    provider.shutdown()
    receiver.server.shutdown()
    hops = receiver.hops(format(ingress.get_span_context().trace_id, "032x"))
    assert set(hops) == set(SPAN_HOPS)
    assert [round((hops[h] - t0 / 1e9) * 1e3) for h in ("ingress_http", "ingress_prepared", "ingress_routed",
                                                        "ingress_sent", "worker_generate", "engine_added",
                                                        "engine_first_token", "engine_finished",
                                                        "ingress_first_delta")] == [0, 1, 2, 3, 4, 5, 6, 7, 10]
