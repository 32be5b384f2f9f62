"""Admission control: a bounded FIFO where requests wait for a worker with room (asyncio, no Ray).

When no worker can take a request's blocks now, piling it onto one anyway
only makes that worker preempt (recompute) running sequences. Instead the
request waits here: first come, first served, only the head asks again (every
``retry_s``), at most ``max_size`` waiting and none longer than ``max_wait_s``.
A request that finds the queue full, or waits out its time, is refused with
``AdmissionRejected`` (the ingress answers 429 with Retry-After).

Refusals should be fast, so a request is also refused on arrival when it
would wait longer than ``max_wait_s`` (``expected_wait``): under sustained
overload the excess is turned away at once instead of after waiting out its
time. The wait comes from ``estimate`` when the caller knows when room will
free up (the kv routing client simulates its running requests' ends), else
from the rate requests have recently left the queue, padded by the most that
such estimates fell short for the waiters of the last ``ERROR_MEMORY_S`` (a
prefill that stalls a worker's decoding, a request that ends later than its
pace said), or, for ``estimate``'s answers with no waiter to check them against
in that time, by as much again: a request is only let wait when it should get
in within its time. (The rate rule is not doubled: it only applies where the
queue has been moving, and doubling it refused requests that the queue would
have admitted in time, e.g. while the routing view was being rebuilt.)
``check_room`` makes the same checks without queueing, so the ingress can
refuse before it reads and tokenizes a request it could not admit.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence, TypeVar

T = TypeVar("T")

ERROR_MEMORY_S = 30.0  # how long an estimate's shortfall pads the estimates after it

# (the items of the requests waiting, first first; the newcomer's item) -> seconds it would wait, or None
WaitEstimate = Callable[[Sequence[Any], Any], "float | None"]


def smoothed(previous: float | None, sample: float, weight: float) -> float:
    """A moving average: ``sample`` weighted ``weight`` against ``previous`` (the first sample
    when there is none yet)."""
    return sample if previous is None else (1 - weight) * previous + weight * sample


class AdmissionRejected(Exception):
    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_full", "expected_wait" or "waited_too_long"
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


@dataclass(slots=True)
class _Waiter:
    turn: asyncio.Event  # set: its turn to ask
    item: Any  # the caller's, for ``estimate``


class AdmissionQueue:
    def __init__(self, max_size: int, max_wait_s: float, retry_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic,
                 on_length: Callable[[int], None] | None = None,
                 on_wait: Callable[[float], None] | None = None, estimate: WaitEstimate | None = None) -> None:
        """``on_length`` hears the queue's length whenever it changes, ``on_wait`` each waiter's
        time in the queue (for metrics); ``estimate`` (optional) says how long a newcomer would wait
        behind the waiters, from the items passed to ``admit``."""
        if max_size < 1 or max_wait_s <= 0 or retry_s <= 0:
            raise ValueError("an admission queue needs max_size >= 1, max_wait_s > 0 and retry_s > 0")
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self.retry_s = retry_s
        self.clock = clock
        self.counters = AdmissionCounters()
        self.on_length = on_length or (lambda n: None)
        self.on_wait = on_wait or (lambda s: None)
        self.estimate = estimate
        self._waiting: deque[_Waiter] = deque()  # one per waiting request, first first
        # Seconds between admissions from the queue while it stays non-empty (moving average;
        # None until two have been seen in one such period).
        self.departure_interval_s: float | None = None
        self._last_departure: float | None = None
        self._errors: deque[tuple[float, float]] = deque()  # (when, a waiter's wait less its estimate)

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def retry_after_s(self) -> int:
        """What a refused client is told to wait (whole seconds, as HTTP wants)."""
        return max(1, math.ceil(self.max_wait_s))

    def estimated_wait(self, item: Any = None) -> tuple[float | None, bool]:
        """How long a request joining the queue now should wait (None: unknown): ``estimate``'s
        answer for its item, else the queue's length at the recent rate of leaving it; and
        whether it is ``estimate``'s answer."""
        if item is not None and self.estimate is not None:
            expected = self.estimate([w.item for w in self._waiting], item)
            if expected is not None:
                return expected, True
        if self.departure_interval_s is None or not self._waiting:
            return None, False
        return (len(self._waiting) + 1) * self.departure_interval_s, False

    def shortfall_s(self) -> float | None:
        """The most that an estimate fell short of a waiter's wait in the last ``ERROR_MEMORY_S``
        (0 when none did; None when no waiter checked one)."""
        forget = self.clock() - ERROR_MEMORY_S
        while self._errors and self._errors[0][0] < forget:
            self._errors.popleft()
        return max(0.0, *(e for _, e in self._errors)) if self._errors else None

    def check_room(self, item: Any = None) -> float | None:
        """Raises AdmissionRejected when a request arriving now (with ``item``, if known) would be
        refused without waiting; else returns its estimated wait."""
        if len(self._waiting) >= self.max_size:
            self.counters.rejected_queue_full += 1
            raise AdmissionRejected(f"all workers are full and {len(self._waiting)} requests are already "
                                    "waiting for one; retry later", "queue_full", self.retry_after_s)
        estimated, modelled = self.estimated_wait(item)
        if estimated is None:
            return None
        shortfall = self.shortfall_s()
        expected = estimated + (shortfall if shortfall is not None else estimated if modelled else 0.0)
        if expected > self.max_wait_s:
            self.counters.rejected_expected_wait += 1
            raise AdmissionRejected(f"all workers are full and the {len(self._waiting)} requests waiting would "
                                    f"take about {expected:.1f} s to admit, more than the {self.max_wait_s:g} s a "
                                    "request may wait; retry later", "expected_wait", self.retry_after_s)
        return estimated

    async def admit(self, attempt: Callable[[], Awaitable[T]], admitted: Callable[[T], bool], item: Any = None) -> T:
        """Run ``attempt`` until ``admitted`` says its result is a yes, keeping FIFO order;
        the first yes is returned. ``item`` stands for the request in ``estimate``.
        Raises AdmissionRejected."""
        if not self._waiting:  # nobody ahead: ask at once
            result = await attempt()
            if admitted(result):
                self.counters.admitted_at_once += 1
                return result
        estimated = self.check_room(item)
        turn = asyncio.Event()
        me = _Waiter(turn, item)
        self._waiting.append(me)
        self.on_length(len(self._waiting))
        self.counters.longest_queue = max(self.counters.longest_queue, len(self._waiting))
        if self._waiting[0] is me:
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
            raise AdmissionRejected(f"no worker had room for this request within {self.max_wait_s:g} s; "
                                    "retry later", "waited_too_long", self.retry_after_s)
        finally:
            waited = self.clock() - started
            if estimated is not None:
                self._errors.append((self.clock(), waited - estimated))
            self.counters.wait_s_total += waited
            head = self._waiting[0] is me
            self._waiting.remove(me)
            if head and self._waiting:
                self._waiting[0].turn.set()
            if not self._waiting:
                self._last_departure = None  # the busy period is over; the next one measures afresh
            self.on_length(len(self._waiting))
            self.on_wait(waited)

    def _departed(self, now: float) -> None:
        if self._last_departure is not None:
            sample = now - self._last_departure
            self.departure_interval_s = smoothed(self.departure_interval_s, sample, 0.25)
        self._last_departure = now
