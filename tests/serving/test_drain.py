"""Graceful drain without a Ray cluster: how ``pagefleet serve`` drains every ingress replica
through its drain board (a fake one here), what a replica does when told, the command's signals,
and the service's count of requests in flight (what a drain waits for)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import pytest

from pagefleet.cluster.drain import FIND_REPLICAS_TIMEOUT_S, BoardLost, DrainReport, DrainState, drain_ingress
from pagefleet.cluster.launch import DrainRequested, StopSignals
from pagefleet.router.ingress import follow_drain
from pagefleet.router.openai.protocol import CompletionRequest
from pagefleet.router.openai.service import INLINE_TEXT_CHARS


class _FakeBoard:
    """A ``DrainBoard`` whose replicas answer on a script: ``at_start`` once told, then their counts
    going down one per poll to ``left`` (what each still has running at the end)."""

    def __init__(self, at_start: dict[str, int], left: dict[str, int] | None = None, polls_to_answer: int = 0):
        self.at_start, self.left = at_start, left or {}
        self.polls_to_answer = polls_to_answer
        self.told = False
        self.polls = 0

    def drain(self) -> None:
        self.told = True

    def state(self) -> DrainState:
        assert self.told
        self.polls += 1
        if self.polls <= self.polls_to_answer:
            return DrainState({}, {})
        step = self.polls - self.polls_to_answer - 1
        return DrainState(dict(self.at_start),
                          {r: max(self.left.get(r, 0), n - step) for r, n in self.at_start.items()})


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def _drain(board, num_replicas, timeout_s):
    said, clock = [], _Clock()
    report = drain_ingress(board, num_replicas, timeout_s, say=said.append, clock=clock, sleep=clock.sleep)
    return report, said


def test_every_replica_is_told_at_once_and_the_drain_ends_when_none_has_requests_left():
    report, said = _drain(_FakeBoard({"a": 3, "b": 0, "c": 2}, polls_to_answer=2), 3, 30.0)
    # answered on the 3rd poll; then 3, 2, 1, 0 left on the busiest replica: 3 more polls of 0.1 s
    assert report == DrainReport(3, 5, 0, pytest.approx(0.5))
    assert said == ["pagefleet: draining 5 requests, up to 30 s", "pagefleet: drained in 0.5 s"]


def test_requests_still_running_at_the_timeout_are_counted_as_cut():
    report, said = _drain(_FakeBoard({"a": 40, "b": 1}, left={"a": 2}), 2, 0.5)
    assert (report.num_in_flight, report.num_cut) == (41, 35)  # 40 - 5 polls
    assert said == ["pagefleet: draining 41 requests, up to 0.5 s", "pagefleet: 0.5 s passed, 35 requests cut"]


def test_replicas_that_never_answer_are_left_out_and_said_so():
    report, said = _drain(_FakeBoard({"a": 1}), 2, 60.0)
    assert (report.num_replicas, report.num_in_flight, report.num_cut) == (1, 1, 0)
    assert report.seconds == pytest.approx(FIND_REPLICAS_TIMEOUT_S, abs=0.2)
    assert said[0] == "pagefleet: 1 of 2 ingress replicas answered; draining those"


def test_a_board_lost_mid_drain_ends_the_drain_and_says_so():
    """Its node was lost (as in test_two_nodes): the command then stops without a traceback."""

    class _LostAfterTwoPolls(_FakeBoard):
        def state(self) -> DrainState:
            if self.polls == 2:
                raise BoardLost("ActorUnavailableError")
            return super().state()

    report, said = _drain(_LostAfterTwoPolls({"a": 5}), 1, 30.0)
    assert report == DrainReport(0, 0, 0, pytest.approx(0.2))  # lost at the third call, two polls in
    assert said == ["pagefleet: draining 5 requests, up to 30 s",
                    "pagefleet: the drain board is gone (ActorUnavailableError); stopping without draining"]


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _ReplicaSideBoard:
    """The board as an ingress replica sees it: ``wait_for_drain`` returns once ``go`` is set."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.reports: list[tuple[str, int]] = []
        self.wait_for_drain = _Remote(self.go.wait)

        async def report(replica_id, num):
            self.reports.append((replica_id, num))
        self.report = _Remote(report)


def test_a_replica_stops_admitting_when_told_and_reports_until_its_last_request_ends(service, fake):
    async def run():
        board = _ReplicaSideBoard()
        fake.step_gate = asyncio.Event()
        running = service.stream_chunks(await service.completion(
            CompletionRequest(prompt=[5, 6], max_tokens=3, stream=True)))
        await running.__anext__()
        follower = asyncio.create_task(follow_drain(board, service, "r1", period_s=0.01))
        await asyncio.sleep(0.05)
        admitting_before = not service.draining
        board.go.set()
        await asyncio.sleep(0.05)
        fake.step_gate.set()
        rest = [c async for c in running]
        await asyncio.wait_for(follower, 5)
        return admitting_before, board.reports, rest

    admitting_before, reports, rest = asyncio.run(run())
    assert admitting_before and service.draining
    assert reports[0] == ("r1", 1) and reports[-1] == ("r1", 0) and {n for _, n in reports} == {0, 1}
    assert rest[-1]["choices"][0]["finish_reason"] == "length"


def test_a_replica_whose_board_is_gone_keeps_serving(service):
    from ray.exceptions import RayActorError

    class _Gone:
        async def fail(self):
            raise RayActorError()

    board = type("B", (), {"wait_for_drain": _Remote(_Gone().fail)})()
    asyncio.run(follow_drain(board, service, "r1"))
    assert not service.draining


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _raised_by(signum):
    try:
        os.kill(os.getpid(), signum)
        time.sleep(1)  # the handler runs in this (the main) thread, between two bytecodes
    except BaseException as exc:  # noqa: BLE001 — what the handler raised is the point
        return type(exc), str(exc)
    return None


def test_sigterm_while_serving_drains_and_a_second_signal_stops_at_once(restore_signals):
    stopping = StopSignals()
    stopping.install()
    assert _raised_by(signal.SIGINT) == (KeyboardInterrupt, "")  # before the app is up: nothing to drain
    stopping = StopSignals()
    stopping.install()
    stopping.serving = True
    assert _raised_by(signal.SIGTERM) == (DrainRequested, "SIGTERM")
    assert _raised_by(signal.SIGINT) == (KeyboardInterrupt, "")
    stopping.teardown()
    assert _raised_by(signal.SIGTERM) is None  # ignored while Serve shuts down
    assert stopping.received == ["SIGTERM", "SIGINT"]


def test_a_prepared_request_counts_until_its_response_ends_or_it_is_dropped(service):
    async def run():
        streamed = await service.completion(CompletionRequest(prompt=[5, 6], max_tokens=3, stream=True))
        dropped = await service.completion(CompletionRequest(prompt=[7], max_tokens=2))
        counts = [service.num_in_flight]
        chunks = [c async for c in service.stream_chunks(streamed)]
        counts.append(service.num_in_flight)
        del dropped  # a response that never started (the client left before it did)
        gc.collect()
        counts.append(service.num_in_flight)
        return counts, chunks

    counts, chunks = asyncio.run(run())
    assert counts == [2, 1, 0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_request_being_tokenized_when_admission_stops_is_refused(service, fake, monkeypatch):
    """Its response has not started, so a 503 to retry elsewhere costs it nothing; once admission
    stopped, the count of requests in flight only goes down."""
    entered, release = threading.Event(), threading.Event()
    real = fake.tokenizer.encode

    def slow_encode(text, **kw):
        entered.set()
        release.wait(10)
        return real(text, **kw)[:10]  # within the test model's context

    monkeypatch.setattr(fake.tokenizer, "encode", slow_encode)

    async def run():
        task = asyncio.create_task(service.completion(
            CompletionRequest(prompt="a" * (INLINE_TEXT_CHARS + 1), max_tokens=2)))
        while not entered.is_set():  # on a tokenizer thread (long text): the loop runs on
            await asyncio.sleep(0.01)
        in_flight = service.stop_admitting()
        release.set()
        with pytest.raises(Exception) as refused:
            await task
        return in_flight, refused.value

    in_flight, refused = asyncio.run(run())
    assert in_flight == 0 and service.num_in_flight == 0
    assert (refused.status_code, refused.code, refused.retry_after_s) == (503, "draining", 5)
