"""Request spans (``worker.tracing``): recorded into memory, as an OTLP exporter would send them."""

from __future__ import annotations

import asyncio

from pagefleet.router.ingress import HandleWorkerClient
from pagefleet.router.openai.service import Job
from pagefleet.worker import tracing
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.replica.deployment import WorkerReplica
from pagefleet.worker.sampling_params import SamplingParams

from channel_fakes import ReplicaHandle, SteppedEngine

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def _ours(recorded) -> list:
    """pagefleet's spans (the web framework may record its own around them)."""
    return [s for s in recorded.get_finished_spans() if s.name.startswith("pagefleet.")]


def _events(span) -> list[str]:
    return [e.name for e in span.events]


def test_a_request_is_one_span_that_continues_the_clients_trace(client, recorded):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3},
                    headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200
    (span,) = _ours(recorded)
    assert span.name == "pagefleet.request" and span.status.is_ok
    assert format(span.context.trace_id, "032x") == CLIENT_TRACE  # under the client's trace
    assert _events(span) == ["prepared", "routed", "first_delta"]
    assert span.attributes["gen_ai.usage.prompt_tokens"] >= 1 and span.attributes["gen_ai.request.n"] == 1
    assert span.start_time <= span.events[0].timestamp <= span.end_time


def test_a_refused_request_ends_its_span_failed(client, fake, recorded):
    from pagefleet.router.openai.errors import too_many_requests

    fake.refuse = too_many_requests("no room", 1)
    assert client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}).status_code == 429
    (span,) = _ours(recorded)
    assert not span.status.is_ok and _events(span) == ["prepared"]


def test_the_worker_replicas_span_is_the_ingress_spans_child(recorded):
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        for step in replica.engine.steps:
            step.set()
        client = HandleWorkerClient(ReplicaHandle(replica))
        job = Job("r1", [1, 2], SamplingParams(max_tokens=2), ranking=["local"])
        job.span = tracing.start_span("pagefleet.request", {"traceparent": TRACEPARENT})
        tokens = [t async for d in client.generate(job) for t in d.sequences[0].token_ids]
        tracing.end(job.span)
        replica._channel_server.close()
        for task in list(client.mux._readers.values()):
            task.cancel()
        return tokens

    assert asyncio.run(run()) == [0, 1]
    worker, ingress = _ours(recorded)
    assert (worker.name, ingress.name) == ("pagefleet.worker.generate", "pagefleet.request")
    assert worker.context.trace_id == ingress.context.trace_id
    assert worker.parent.span_id == ingress.context.span_id
    assert worker.attributes["pagefleet.request_id"] == "r1" and _events(ingress) == ["sent"]
