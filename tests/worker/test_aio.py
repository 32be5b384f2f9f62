"""``cancel_and_wait``: the one way the replica and the ingress stop their background tasks."""

from __future__ import annotations

import asyncio

from pagefleet.worker.aio import cancel_and_wait


def test_cancels_running_tasks_and_returns_once_they_ended():
    async def main():
        ended = []

        async def forever(name):
            try:
                await asyncio.sleep(3600)
            finally:
                ended.append(name)

        a, b = asyncio.ensure_future(forever("a")), asyncio.ensure_future(forever("b"))
        await asyncio.sleep(0)
        await cancel_and_wait(a, None, b)
        return ended, a.cancelled(), b.cancelled()

    assert asyncio.run(main()) == (["a", "b"], True, True)


def test_a_task_that_already_failed_or_finished_raises_nothing():
    async def main():
        async def fail():
            raise ValueError("gone")

        failed, done = asyncio.ensure_future(fail()), asyncio.ensure_future(asyncio.sleep(0, "ok"))
        await asyncio.sleep(0.01)
        await cancel_and_wait(failed, done)
        return type(failed.exception()).__name__, done.result()

    assert asyncio.run(main()) == ("ValueError", "ok")


def test_nothing_to_stop():
    assert asyncio.run(cancel_and_wait()) is None
    assert asyncio.run(cancel_and_wait(None)) is None
