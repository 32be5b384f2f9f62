"""Admission control: a bounded queue where requests wait for a worker with room (asyncio, no Ray).

When no worker can take a request's blocks now, piling it onto one anyway
only makes that worker preempt (recompute) running sequences. Instead the
request waits here: first come, first served, only the head asks again (every
``retry_s``), at most ``max_size`` waiting and none longer than ``max_wait_s``.
A request's ``priority`` (vLLM's; lower first, 0 unless the workers schedule by
priority) places it ahead of the waiters of a higher value, but never ahead of
the head, which may be asking for room at that moment.
A request that finds the queue full, or waits out its time, is refused with
``AdmissionRejected`` (the ingress answers 429 with Retry-After).

Refusals should be fast, so a request is also refused as soon as its wait is
expected to pass ``max_wait_s`` (``expected_wait``): under overload the excess
is turned away at once instead of after waiting out its time. Where a
``forecast`` is given (kv routing: when the workers' running sequences will
give room back, ``room_forecast``), it says each waiting request's wait: a
newcomer is refused when its own is too long, and a request already waiting
when its forecast, redone every ``review_s`` while the queue moves, passes the
time it has left (less one review and one retry: room it counts on that does
not come must be noticed while it may still wait). Without one (or while it knows nothing), the queue goes by
the rate requests have recently left it: a newcomer is refused when the queue
ahead would take longer than ``max_wait_s`` to clear at that rate.
``check_room`` makes the same checks for the queue as it stands, without
queueing, so the ingress can refuse before it reads and tokenizes a request it
could not admit.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence, TypeVar

T = TypeVar("T")

# Each waiting request's wait in seconds, in queue order, given what each needs (``inf``: no
# room is known to come); None: nothing is known (the queue goes by its departure rate).
Forecast = Callable[[Sequence[Any]], "list[float] | None"]

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
    refused_while_waiting: int = 0  # of rejected_expected_wait: forecast past its time after joining the queue
    wait_s_total: float = 0.0  # of the requests that waited, admitted or not
    longest_queue: int = 0


@dataclass(slots=True, eq=False)
class _Waiter:
    need: Any  # what the forecast is given for it
    deadline: float
    priority: int = 0
    turn: asyncio.Event = field(default_factory=asyncio.Event)  # set: its turn, or its refusal
    refusal: AdmissionRejected | None = None


class AdmissionQueue:
    def __init__(self, max_size: int, max_wait_s: float, retry_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic,
                 on_length: Callable[[int], None] | None = None,
                 on_wait: Callable[[float], None] | None = None,
                 forecast: Forecast | None = None, review_s: float = 0.05) -> None:
        """``on_length`` hears the queue's length whenever it changes, ``on_wait`` each waiter's
        time in the queue (for metrics). ``forecast``: the waits of requests needing what
        ``admit`` is given, in queue order (module docstring)."""
        if max_size < 1 or max_wait_s <= 0 or retry_s <= 0:
            raise ValueError("an admission queue needs max_size >= 1, max_wait_s > 0 and retry_s > 0")
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self.retry_s = retry_s
        self.clock = clock
        self.forecast = forecast
        self.review_s = review_s
        # A forecast must leave this much of a request's wait: a release it counts on that does not
        # come is seen at the next review, and that review, with the head's next try, must come
        # before the request's time is up.
        self.margin_s = review_s + retry_s
        self.counters = AdmissionCounters()
        self.on_length = on_length or (lambda n: None)
        self.on_wait = on_wait or (lambda s: None)
        self._waiting: deque[_Waiter] = deque()  # first come first served
        self._last_review = -math.inf
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

    def expected_wait_s(self, priority: int | None = None) -> float | None:
        """How long a request joining the queue now would wait, at the recent rate (None: unknown);
        without ``priority``, one joining at the end."""
        if self.departure_interval_s is None or not self._waiting:
            return None
        ahead = len(self._waiting) if priority is None else self._place(priority)
        return (ahead + 1) * self.departure_interval_s

    def _place(self, priority: int) -> int:
        """Where a newcomer of ``priority`` joins: behind the head and every waiter of a value up
        to its own."""
        i = len(self._waiting)
        while i > 1 and self._waiting[i - 1].priority > priority:
            i -= 1
        return i

    def check_room(self, need: Any = None, priority: int | None = None) -> None:
        """Raises AdmissionRejected when a request arriving now would be refused without waiting.
        With ``need`` (what the forecast takes) its own forecast wait decides, at its place by
        ``priority``; without, the last waiter's (the newcomer would wait longer, unless its
        priority places it ahead: that is not known before its body is read)."""
        if len(self._waiting) >= self.max_size:
            self.counters.rejected_queue_full += 1
            raise AdmissionRejected(f"all workers are full and {len(self._waiting)} requests are already "
                                    "waiting for one; retry later", "queue_full", self.retry_after_s)
        waits, place = None, len(self._waiting)
        if self.forecast is not None and (need is not None or self._waiting):
            needs = [w.need for w in self._waiting]
            if need is not None:
                place = self._place(priority or 0)
                needs.insert(place, need)
            else:
                place = len(needs) - 1
            waits = self.forecast(needs)
        if waits is not None:
            if waits[place] > self.max_wait_s - self.margin_s:
                self.counters.rejected_expected_wait += 1
                raise self._too_long(waits[place], self.max_wait_s)
            return
        expected = self.expected_wait_s(priority)
        if expected is not None and expected > self.max_wait_s:
            self.counters.rejected_expected_wait += 1
            raise AdmissionRejected(f"all workers are full and the {len(self._waiting)} requests waiting would "
                                    f"take about {expected:.1f} s to admit, more than the {self.max_wait_s:g} s a "
                                    "request may wait; retry later", "expected_wait", self.retry_after_s)

    def _too_long(self, wait: float, left: float) -> AdmissionRejected:
        """The refusal of a request whose forecast ``wait`` passes the ``left`` seconds it may wait."""
        if math.isinf(wait):
            return AdmissionRejected("all workers are full, and the room their running requests free when they "
                                     "end is not enough for this request and those ahead of it; retry later",
                                     "expected_wait", self.retry_after_s)
        return AdmissionRejected(f"all workers are full; room for this request is expected in about {wait:.1f} s "
                                 f"(when their running requests end), more than the {left:.1f} s it may wait; "
                                 "retry later", "expected_wait", max(1, math.ceil(wait)))

    async def admit(self, attempt: Callable[[], Awaitable[T]], admitted: Callable[[T], bool], need: Any = None,
                    priority: int = 0) -> T:
        """Run ``attempt`` until ``admitted`` says its result is a yes, keeping the queue's order
        (first come, first served among equal priorities); the first yes is returned. ``need``:
        what the forecast is given for this request. Raises AdmissionRejected."""
        if not self._waiting:  # nobody ahead: ask at once
            result = await attempt()
            if admitted(result):
                self.counters.admitted_at_once += 1
                return result
        self.check_room(need, priority)
        started = self.clock()
        me = _Waiter(need, started + self.max_wait_s, priority)
        self._waiting.insert(self._place(priority), me)
        self.on_length(len(self._waiting))
        self.counters.longest_queue = max(self.counters.longest_queue, len(self._waiting))
        if self._waiting[0] is me:
            me.turn.set()
        try:
            while True:
                left = me.deadline - self.clock()
                if left <= 0:
                    break
                if not me.turn.is_set():
                    try:
                        await asyncio.wait_for(me.turn.wait(), left)
                    except asyncio.TimeoutError:
                        continue  # the clock has the last word
                if me.refusal is not None:
                    raise me.refusal
                result = await attempt()
                if admitted(result):
                    self.counters.admitted_after_waiting += 1
                    self._departed(self.clock())
                    return result
                self._review()
                if me.refusal is not None:
                    raise me.refusal
                left = me.deadline - self.clock()
                if left <= 0:
                    break
                await asyncio.sleep(min(self.retry_s, left))
            self.counters.rejected_waited_too_long += 1
            raise AdmissionRejected(f"{WAITED_OUT} {self.max_wait_s:g} s; retry later", "waited_too_long",
                                    self.retry_after_s)
        finally:
            waited = self.clock() - started
            self.counters.wait_s_total += waited
            head = self._waiting[0] is me
            self._waiting.remove(me)
            if head and self._waiting:
                self._waiting[0].turn.set()
            if not self._waiting:
                self._last_departure = None  # the busy period is over; the next one measures afresh
            self.on_length(len(self._waiting))
            self.on_wait(waited)

    def _review(self) -> None:
        """At most every ``review_s``: refuse each waiter whose forecast wait passes its time left,
        less ``margin_s`` (and wake it to say so)."""
        now = self.clock()
        if self.forecast is None or now - self._last_review < self.review_s:
            return
        self._last_review = now
        waits = self.forecast([w.need for w in self._waiting])
        if waits is None:
            return
        for waiter, wait in zip(self._waiting, waits):
            if waiter.refusal is None and wait > waiter.deadline - now - self.margin_s:
                waiter.refusal = self._too_long(wait, waiter.deadline - now)
                self.counters.rejected_expected_wait += 1
                self.counters.refused_while_waiting += 1
                waiter.turn.set()

    def _departed(self, now: float) -> None:
        if self._last_departure is not None:
            sample = now - self._last_departure
            previous = self.departure_interval_s
            self.departure_interval_s = sample if previous is None else 0.75 * previous + 0.25 * sample
        self._last_departure = now
