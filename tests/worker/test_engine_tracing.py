"""The engine thread marks a traced request's span: taken in, first token, finished."""

from __future__ import annotations

import asyncio

from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams, tracing


def test_the_engine_thread_marks_a_traced_requests_span_in_order(tiny_checkpoint, recorded):
    engine = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32",
                                       kv_cache_bytes=16 << 20))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    async def run(request_id, span):
        return [t async for d in engine.generate(request_id, [5, 6, 7, 8], params, span=span)
                for t in d.sequences[0].token_ids]

    try:
        span = tracing.start_span("pagefleet.worker.generate")
        traced = asyncio.run(run("traced", span))
        tracing.end(span)
        untraced = asyncio.run(run("untraced", None))
    finally:
        engine.shutdown()
    assert traced == untraced and len(traced) == 5  # a span changes nothing of the output
    (finished,) = recorded.get_finished_spans()
    assert [e.name for e in finished.events] == ["engine_added", "engine_first_token", "engine_finished"]
    times = [e.timestamp for e in finished.events]
    assert finished.start_time <= times[0] <= times[1] <= times[2] <= finished.end_time
    assert engine._spans == {}  # nothing kept once the request ended
