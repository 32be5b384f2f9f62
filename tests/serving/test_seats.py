"""A worker replica's seat line: a freed seat goes to the waiting call the engine would admit
first, by priority (lower first) then arrival; a caller that leaves gives up its place."""

from __future__ import annotations

import asyncio

from pagefleet.worker.replica.seats import Seats


def test_a_freed_seat_goes_to_the_best_priority_then_the_earliest_waiter():
    async def run():
        seats = Seats(1)
        await seats.take()
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            await seats.take(priority)
            order.append(name)

        tasks = [asyncio.ensure_future(wait(name, p)) for name, p in (("low1", 5), ("low2", 5), ("high", -2),
                                                                     ("mid", 0), ("gone", -9))]
        await asyncio.sleep(0)
        assert len(seats.waiters) == 5 and not seats.try_take()
        tasks[4].cancel()  # leaves the line before any seat frees
        await asyncio.sleep(0)
        assert len(seats.waiters) == 4
        for expected in (["high"], ["high", "mid"], ["high", "mid", "low1"], ["high", "mid", "low1", "low2"]):
            seats.free()
            await asyncio.sleep(0)
            assert order == expected and seats.taken == 1
        seats.free()
        assert seats.taken == 0 and seats.try_take()

    asyncio.run(run())
