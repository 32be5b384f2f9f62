"""Admission control: a bounded FIFO where requests wait for a worker with room (asyncio, no Ray).

When no worker can take a request's blocks now, piling it onto one anyway
only makes that worker preempt (recompute) running sequences. Instead the
request waits here: first come, first served, only the head asks again (every
``retry_s``), at most ``max_size`` waiting and none longer than ``max_wait_s``.
A request that finds the queue full, or waits out its time, is refused with
``AdmissionRejected`` (the ingress answers 429 with Retry-After).

Refusals should be fast, so a request is also refused on arrival when the
queue ahead of it would take longer than ``max_wait_s`` to clear at the rate
requests have recently left it (``expected_wait``): under sustained overload
the excess is turned away at once instead of after waiting out its time.
``check_room`` makes the same two checks without queueing, so the ingress can
refuse before it reads and tokenizes a request it could not admit.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

# How the message of a request refused after waiting out its time begins (clients and benchmarks
# tell it from a refusal on arrival by it).
WAITED_OUT = "no worker had room for this request within"


REJECTION_REASONS = ("queue_full", "expected_wait", "waited_too_long")


class AdmissionRejected(Exception):
    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason  # one of REJECTION_REASONS
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class AdmissionCounters:
    admitted_at_once: int = 0
    admitted_after_waiting: int = 0
    rejected_queue_full: int = 0
    rejected_expected_wait: int = 0
    rejected_waited_too_long: int = 0
    wait_s_total: float = 0.0  # of the requests that waited, admitted or not
    longest_queue: int = 0


class AdmissionQueue:
    def __init__(self, max_size: int, max_wait_s: float, retry_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic,
                 on_length: Callable[[int], None] | None = None,
                 on_wait: Callable[[float], None] | None = None) -> None:
        """``on_length`` hears the queue's length whenever it changes, ``on_wait`` each waiter's
        time in the queue (for metrics)."""
        if max_size < 1 or max_wait_s <= 0 or retry_s <= 0:
            raise ValueError("an admission queue needs max_size >= 1, max_wait_s > 0 and retry_s > 0")
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self.retry_s = retry_s
        self.clock = clock
        self.counters = AdmissionCounters()
        self.on_length = on_length or (lambda n: None)
        self.on_wait = on_wait or (lambda s: None)
        self._waiting: deque[asyncio.Event] = deque()  # one per waiting request; set = its turn
        # Seconds between admissions from the queue while it stays non-empty (moving average;
        # None until two have been seen in one such period).
        self.departure_interval_s: float | None = None
        self._last_departure: float | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def retry_after_s(self) -> int:
        """What a refused client is told to wait (whole seconds, as HTTP wants)."""
        return max(1, math.ceil(self.max_wait_s))

    def expected_wait_s(self) -> float | None:
        """How long a request joining the queue now would wait, at the recent rate (None: unknown)."""
        if self.departure_interval_s is None or not self._waiting:
            return None
        return (len(self._waiting) + 1) * self.departure_interval_s

    def check_room(self) -> None:
        """Raises AdmissionRejected when a request arriving now would be refused without waiting."""
        if len(self._waiting) >= self.max_size:
            self.counters.rejected_queue_full += 1
            raise AdmissionRejected(f"all workers are full and {len(self._waiting)} requests are already "
                                    "waiting for one; retry later", "queue_full", self.retry_after_s)
        expected = self.expected_wait_s()
        if expected is not None and expected > self.max_wait_s:
            self.counters.rejected_expected_wait += 1
            raise AdmissionRejected(f"all workers are full and the {len(self._waiting)} requests waiting would "
                                    f"take about {expected:.1f} s to admit, more than the {self.max_wait_s:g} s a "
                                    "request may wait; retry later", "expected_wait", self.retry_after_s)

    async def admit(self, attempt: Callable[[], Awaitable[T]], admitted: Callable[[T], bool]) -> T:
        """Run ``attempt`` until ``admitted`` says its result is a yes, keeping FIFO order;
        the first yes is returned. Raises AdmissionRejected."""
        if not self._waiting:  # nobody ahead: ask at once
            result = await attempt()
            if admitted(result):
                self.counters.admitted_at_once += 1
                return result
        self.check_room()
        turn = asyncio.Event()
        self._waiting.append(turn)
        self.on_length(len(self._waiting))
        self.counters.longest_queue = max(self.counters.longest_queue, len(self._waiting))
        if self._waiting[0] is turn:
            turn.set()
        started = self.clock()
        deadline = started + self.max_wait_s
        try:
            while True:
                left = deadline - self.clock()
                if left <= 0:
                    break
                if not turn.is_set():
                    try:
                        await asyncio.wait_for(turn.wait(), left)
                    except asyncio.TimeoutError:
                        continue  # the clock has the last word
                result = await attempt()
                if admitted(result):
                    self.counters.admitted_after_waiting += 1
                    self._departed(self.clock())
                    return result
                left = deadline - self.clock()
                if left <= 0:
                    break
                await asyncio.sleep(min(self.retry_s, left))
            self.counters.rejected_waited_too_long += 1
            raise AdmissionRejected(f"{WAITED_OUT} {self.max_wait_s:g} s; retry later", "waited_too_long",
                                    self.retry_after_s)
        finally:
            waited = self.clock() - started
            self.counters.wait_s_total += waited
            head = self._waiting[0] is turn
            self._waiting.remove(turn)
            if head and self._waiting:
                self._waiting[0].set()
            if not self._waiting:
                self._last_departure = None  # the busy period is over; the next one measures afresh
            self.on_length(len(self._waiting))
            self.on_wait(waited)

    def _departed(self, now: float) -> None:
        if self._last_departure is not None:
            sample = now - self._last_departure
            previous = self.departure_interval_s
            self.departure_interval_s = sample if previous is None else 0.75 * previous + 0.25 * sample
        self._last_departure = now
