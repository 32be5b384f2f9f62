"""Mid-stream failover in the ingress's worker client: when a worker replica's engine dies after a
request's output started, each unfinished sequence goes on on another replica from exactly what
the ingress had received (``ResumeState``), and the client's stream carries on with no seam.

Two real worker replicas, their engines scripted; the Serve handle is a stand-in that sends every
request to the first replica until its engine has died, then to the second."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagefleet.router.ingress import MAX_ENGINE_DEATHS, MAX_FAILOVERS, HandleWorkerClient
from pagefleet.router.openai.errors import OpenAIError
from pagefleet.router.openai.service import Job
from pagefleet.worker.core.resume import ResumeState
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.errors import EngineDeadError
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta
from pagefleet.worker.replica.deployment import WorkerReplica
from pagefleet.worker.sampling_params import SamplingParams

from channel_fakes import Call, IdleEngineParts, ReasonMetrics


class ScriptedEngine(IdleEngineParts):
    """Sequence i's token at output position p is 100 * i + p, its text "<token> "; one delta per
    position, every sequence in it. ``die_at``: the engine dies when a request reaches that
    position (after sending the ones before)."""

    def __init__(self, die_at: int | None = None) -> None:
        self.model_config = SimpleNamespace(served_model_name="m", max_model_len=64)
        self.die_at = die_at
        self.requests: list[tuple[str, list[int], SamplingParams, ResumeState | None]] = []

    async def generate(self, request_id, prompt_token_ids, params, extra_keys=(), block_hashes=None, span=None,
                       resume=None, forward=None, client="", priority=0, lora_name=None, lora_path=None):
        self.requests.append((request_id, list(prompt_token_ids), params, resume))
        indices = [resume.seq_index] if resume is not None else list(range(params.n))
        start = len(resume.output_token_ids) if resume is not None else 0
        for position in range(start, params.max_tokens):
            await asyncio.sleep(0)
            if self.die_at is not None and position >= self.die_at:
                raise EngineDeadError("the engine's step loop died")
            last = position == params.max_tokens - 1
            yield RequestOutputDelta(request_id, [CompletionOutput(i, f"{100 * i + position} ", [100 * i + position],
                                                                   None, "length" if last else None)
                                                  for i in indices], len(prompt_token_ids), 0, last)


class _Handle:
    """Serve's handle over two replicas: requests go to the first until its engine has died."""

    app_name = "app"
    deployment_name = "PagefleetWorker"

    def __init__(self, first: WorkerReplica, second: WorkerReplica) -> None:
        self.replicas = [first, second]

    def options(self, method_name, stream):
        handle = self

        class Method:
            def remote(self, arg):
                replica = handle.replicas[1] if handle.failed else handle.replicas[0]
                if method_name == "channel":
                    return Call(replica.channel(arg))
                return Call(replica.generate(arg))

        return Method()

    failed = False


def _replicas(die_at: int, second_dies_at: int | None = None) -> tuple[WorkerReplica, WorkerReplica]:
    first = WorkerReplica(EngineArgs(), engine_factory=lambda _: ScriptedEngine(die_at), channel_host="127.0.0.1")
    second = WorkerReplica(EngineArgs(), engine_factory=lambda _: ScriptedEngine(second_dies_at),
                           channel_host="127.0.0.1")
    return first, second


async def _run(params: SamplingParams, die_at: int, second_dies_at: int | None = None):
    return await _run_on(*_replicas(die_at, second_dies_at), params)


async def _run_on(first: WorkerReplica, second: WorkerReplica, params: SamplingParams):
    handle = _Handle(first, second)
    original = first.engine.generate

    async def failing(*args, **kwargs):
        try:
            async for d in original(*args, **kwargs):
                yield d
        except EngineDeadError:
            handle.failed = True
            raise

    first.engine.generate = failing
    metrics = ReasonMetrics()
    client = HandleWorkerClient(handle, metrics=metrics)
    job = Job("req", [7, 8, 9], params)
    outputs: dict[int, list[CompletionOutput]] = {}
    try:
        async for delta in client.generate(job):
            for seq in delta.sequences:
                outputs.setdefault(seq.index, []).append(seq)
    finally:
        for replica in (first, second):
            replica._channel_server.close()
        for task in list(client.mux._readers.values()):
            task.cancel()
        await asyncio.sleep(0)
    return outputs, first.engine, second.engine, metrics


def test_a_sequence_goes_on_on_another_replica_from_what_the_ingress_received():
    outputs, first, second, metrics = asyncio.run(_run(SamplingParams(max_tokens=8, seed=5), die_at=3))
    (seq,) = outputs.values()
    assert [t for out in seq for t in out.token_ids] == list(range(8))  # each token once, in order
    assert "".join(out.text for out in seq) == "".join(f"{p} " for p in range(8))
    assert [out.finish_reason for out in seq][-1] == "length"
    (request_id, prompt, params, resume), = second.requests
    assert prompt == [7, 8, 9] and params.n == 1 and params.seed == 5 and params.max_tokens == 8
    assert resume == ResumeState([0, 1, 2], len("0 1 2 "), 0)
    assert request_id != "req" and metrics.failovers == ["worker_failed"]


def test_each_unfinished_sequence_of_n_goes_on_under_its_own_index():
    outputs, first, second, metrics = asyncio.run(_run(SamplingParams(max_tokens=6, n=2), die_at=2))
    for i in (0, 1):
        assert [t for out in outputs[i] for t in out.token_ids] == [100 * i + p for p in range(6)]
    resumed = sorted((r[3].seq_index, r[3].output_token_ids, r[2].n) for r in second.requests)
    assert resumed == [(0, [0, 1], 1), (1, [100, 101], 1)]
    assert metrics.failovers == ["worker_failed"]


def test_a_request_fails_over_a_bounded_number_of_times_then_ends_with_the_error():
    with pytest.raises(OpenAIError) as err:
        asyncio.run(_run(SamplingParams(max_tokens=8), die_at=2, second_dies_at=3))
    assert err.value.status_code == 503 and err.value.code == "worker_failed"
    assert MAX_FAILOVERS == 2


def test_a_request_that_an_engine_dies_under_twice_is_not_sent_to_a_third():
    """The second replica's engine dies under the resumed request too: it is taken for the cause
    and ends with the error rather than go on to another replica."""
    first, second = _replicas(die_at=2, second_dies_at=4)
    with pytest.raises(OpenAIError) as err:
        asyncio.run(_run_on(first, second, SamplingParams(max_tokens=8)))
    assert err.value.status_code == 503 and err.value.code == "worker_failed"
    assert MAX_ENGINE_DEATHS == 1
    assert [r[3].output_token_ids for r in second.engine.requests] == [[0, 1]]  # sent there once
