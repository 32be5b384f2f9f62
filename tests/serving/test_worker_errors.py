"""What a worker's failure becomes at the ingress: clean OpenAI errors, never a Ray traceback,
and a retry on another replica only for a request that had produced nothing yet."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest
import ray.exceptions as ray_exceptions
from ray.serve.exceptions import BackPressureError

from pagefleet.router.ingress import HandleWorkerClient
from pagefleet.router.openai.service import Job
from pagefleet.router.worker_client.delta_mux import notice_error
from pagefleet.router.worker_client.worker_errors import worker_failure
from pagefleet.worker.core.resume import ResumeState
from pagefleet.worker.errors import CompileQueueFull, EngineDeadError
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta
from pagefleet.worker.replica.delta_channel import DeltaChannel
from pagefleet.worker.replica.wire import Ended, Notice, Placed
from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import SamplingParams

from channel_fakes import ReasonMetrics


def _as_ray_task_error(cause: Exception) -> Exception:
    """What a Serve handle raises for an exception inside the replica: a RayTaskError whose text
    carries the remote traceback (file paths, pid, address)."""
    try:
        raise cause
    except Exception as exc:
        err = ray_exceptions.RayTaskError("generate", "Traceback (most recent call last):\n  File "
                                          "\"/home/u/pagefleet/worker/engine.py\", line 9\n(pid=4242, ip=10.1.2.3)",
                                          exc)
    return err.as_instanceof_cause()


def test_an_engine_refusal_is_a_400_with_the_engines_words_only():
    error, retry = worker_failure(_as_ray_task_error(InvalidRequest("stop has 40 strings", "stop")))
    assert (error.status_code, error.param, error.message, retry) == (400, "stop", "stop has 40 strings", False)


@pytest.mark.parametrize("exc", [
    _as_ray_task_error(EngineDeadError("the engine loop died: RuntimeError('CUDA error at 0x7f..')")),
    ray_exceptions.ActorDiedError(),
    ray_exceptions.ActorUnavailableError("unavailable", b"\x00" * 16),
])
def test_a_dead_worker_is_a_retryable_503_without_details(exc):
    error, retry = worker_failure(exc)
    assert (error.status_code, error.code, error.retry_after_s, retry) == (503, "worker_failed", 1, True)
    assert error.message == "the worker replica serving this request failed; retry the request"


def test_full_queues_are_a_429_with_retry_after():
    error, retry = worker_failure(BackPressureError(num_queued_requests=9, max_queued_requests=8))
    assert (error.status_code, error.type, error.code, error.retry_after_s, retry) == \
        (429, "requests", "rate_limit_exceeded", 1, False)
    assert "max_queued" not in error.message


def test_a_full_grammar_compile_queue_is_a_429_on_both_paths():
    message = "this client has 4 grammars compiling or queued, the most it may"
    for exc in (_as_ray_task_error(CompileQueueFull(message)), notice_error(Notice("r", "busy", message), "w1")):
        error, retry = worker_failure(exc)
        assert (error.status_code, error.code, error.retry_after_s, retry) == (429, "rate_limit_exceeded", 1, False)
        assert error.message == message + "; retry later"


def test_anything_else_is_a_500_that_names_only_an_error_id(caplog):
    error, retry = worker_failure(_as_ray_task_error(KeyError("/srv/models/secret-path")))
    assert error.status_code == 500 and retry is False
    assert "secret-path" not in error.message and "10.1.2.3" not in error.message
    assert "error id" in error.message


class _Response:
    """A Serve DeploymentResponseGenerator stand-in for a channel request: yields ``Placed``, puts
    ``deltas`` on the caller's channel (a real ``DeltaChannel``), then raises ``fail`` or yields
    ``Ended``."""

    def __init__(self, deltas, fail=None):
        self.deltas, self.fail, self.cancelled = deltas, fail, False
        self.channel = None
        self.request_id = None  # the id it was sent under (each send has its own)
        self._items = self._run()

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._items.__anext__()

    async def _run(self):
        yield Placed("w0")
        for d in self.deltas:
            self.channel.put(msgspec.structs.replace(d, request_id=self.request_id))
            while self.channel.pending:  # taken by the ingress's channel reader
                await asyncio.sleep(0)
            for _ in range(3):  # and handed to the request's reader
                await asyncio.sleep(0)
        if self.fail is not None:
            raise self.fail
        yield Ended(len(self.deltas))

    def cancel(self):
        self.cancelled = True


class _OwnStreamResponse(_Response):
    """A request that started before the caller's channel was attached: its deltas follow its
    ``Placed(on_channel=False)`` on its own stream."""

    async def _run(self):
        yield Placed("w0", on_channel=False)
        for d in self.deltas:
            await asyncio.sleep(0)
            yield msgspec.structs.replace(d, request_id=self.request_id)
        if self.fail is not None:
            raise self.fail


class _ChannelStream:
    def __init__(self, channel):
        self._items = channel.batches(idle_close_s=0.05)  # a test channel closes at once when idle

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._items.__anext__()

    def cancel(self):
        pass


class _Handle:
    """The worker deployment's handle: ``generate`` answers with the scripted responses in turn,
    ``channel`` with the stream of the one replica's channel."""

    app_name = "app"
    deployment_name = "PagefleetWorker"

    def __init__(self, responses):
        self.responses = list(responses)
        self.sent = []
        self.requests = []  # copies of the WorkerRequests sent
        self.channels: dict[str, DeltaChannel] = {}

    def options(self, method_name, stream):
        return _Method(self, method_name)


class _Method:
    def __init__(self, handle, name):
        self.handle, self.name = handle, name

    def remote(self, arg):
        channel = self.handle.channels.setdefault(arg.channel if self.name == "generate" else arg.channel_id,
                                                  DeltaChannel())
        if self.name == "channel":
            return _ChannelStream(channel)
        self.handle.sent.append((arg.request_id, arg.ranking))
        self.handle.requests.append(dataclasses.replace(arg))
        response = self.handle.responses.pop(0)
        response.channel, response.request_id = channel, arg.request_id
        return response


def _delta(token, finished):
    return RequestOutputDelta("r-0", [CompletionOutput(0, "x", [token], None, "length" if finished else None)], 2, 0,
                              finished)


def _job(ranking=None):
    return Job("r-0", [5, 6], SamplingParams(max_tokens=2), ranking=ranking)


async def _collect(client, job=None):
    return [d async for d in client.generate(job or _job())]


def test_a_request_whose_worker_died_before_any_output_goes_to_another_replica():
    dead = _Response([], ray_exceptions.ActorDiedError())
    good = _Response([_delta(1, False), _delta(2, True)])
    handle = _Handle([dead, good])
    metrics = ReasonMetrics()
    deltas = asyncio.run(_collect(HandleWorkerClient(handle, metrics=metrics), _job(ranking=["w1", "w0"])))
    assert [d.sequences[0].token_ids for d in deltas] == [[1], [2]] and metrics.resends == ["worker_failed"]
    # the retry drops the ranking whose first choice just failed: the request router picks again
    # and it goes under an id of its own: the replica the first send ran on may still hold that one
    assert handle.sent == [("r-0", ["w1", "w0"]), ("r-0#2", None)] and dead.cancelled and not good.cancelled


def test_a_request_with_output_already_sent_goes_on_elsewhere_and_repeats_none_of_it():
    dying = _Response([_delta(1, False)], ray_exceptions.ActorDiedError())
    handle = _Handle([dying, _Response([_delta(9, True)])])
    got = []

    async def run():
        async for d in HandleWorkerClient(handle).generate(_job()):
            got.append(d)

    asyncio.run(run())
    assert [d.sequences[0].token_ids for d in got] == [[1], [9]]
    # failed over (not resent): under an id of its own, from the token and text it had
    assert handle.sent == [("r-0", None), ("r-0~1.0", None)]
    assert handle.requests[1].resume == ResumeState([1], 1, 0) and handle.requests[1].params.n == 1


def test_retries_are_bounded():
    handle = _Handle([_Response([], ray_exceptions.ActorDiedError()) for _ in range(5)])
    metrics = ReasonMetrics()
    with pytest.raises(Exception) as failed:
        asyncio.run(_collect(HandleWorkerClient(handle, metrics=metrics)))
    assert failed.value.status_code == 503 and len(handle.sent) == 3
    assert metrics.resends == ["worker_failed", "worker_failed"]


def test_a_request_placed_before_a_channel_was_attached_reads_its_own_stream():
    handle = _Handle([_OwnStreamResponse([_delta(1, False), _delta(2, True)])])
    client = HandleWorkerClient(handle)
    deltas = asyncio.run(_collect(client))
    assert [d.sequences[0].token_ids for d in deltas] == [[1], [2]] and client.mux.counters.deltas == 0


def test_own_stream_requests_fail_and_retry_like_channel_ones():
    dead = _OwnStreamResponse([], ray_exceptions.ActorDiedError())
    good = _OwnStreamResponse([_delta(5, True)])
    handle = _Handle([dead, good])
    assert [d.sequences[0].token_ids for d in asyncio.run(_collect(HandleWorkerClient(handle)))] == [[5]]
    assert len(handle.sent) == 2 and dead.cancelled
