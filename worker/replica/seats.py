"""A worker replica's request limit, over both ways a request arrives.

Serve counts only its own calls against a deployment's ``max_ongoing_requests``; requests sent
on a delta channel's connection (``worker.replica.wire``) never pass through it. So the replica
keeps the count itself: at most ``limit`` requests in the engine, whichever way they came. A
request on a connection takes a seat only if one is free (``try_take``; otherwise the caller
sends it through Serve), and a Serve call past the limit waits here for one, in the order the
engine would admit it: by priority (lower first; all 0 unless the engine schedules by
priority), then first come, first served (``take``).
"""

from __future__ import annotations

import asyncio
import heapq
from itertools import count


class Seats:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self.waiters: list[tuple[int, int, asyncio.Future]] = []  # a heap: (priority, arrival, seat)
        self._arrivals = count()

    @property
    def demand(self) -> int:
        """Requests holding a seat plus Serve calls in line for one: what this replica was asked to
        run, whichever way each request came (its load, as Serve's autoscaler reads it)."""
        return self.taken + sum(not seat.done() for _, _, seat in self.waiters)

    def try_take(self) -> bool:
        """Takes a seat if one is free and nobody waits for one."""
        if self.taken >= self.limit or self.waiters:
            return False
        self.taken += 1
        return True

    async def take(self, priority: int = 0) -> None:
        """Takes a seat, waiting in line for one if need be (ahead of those of a higher priority
        value)."""
        if self.try_take():
            return
        seat = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), seat)
        heapq.heappush(self.waiters, entry)
        try:
            await seat  # ``free`` hands its seat over (``taken`` stays)
        except asyncio.CancelledError:
            if seat.done() and not seat.cancelled():  # handed over as the caller went away
                self.free()
            elif entry in self.waiters:
                self.waiters.remove(entry)
                heapq.heapify(self.waiters)
            raise

    def free(self) -> None:
        """Gives a seat back: to the first in line still waiting, else to no one."""
        while self.waiters:
            seat = heapq.heappop(self.waiters)[2]
            if not seat.done():
                seat.set_result(None)
                return
        self.taken -= 1
