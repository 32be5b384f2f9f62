"""asyncio helpers shared by the worker replica and the ingress."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def cancel_and_wait(*tasks: asyncio.Future | None) -> None:
    """Cancel ``tasks`` (None: nothing to stop) and wait until each has ended, whatever its outcome."""
    running = [task for task in tasks if task is not None]
    if not running:
        return
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several streams as they come; the first error ends all of them. Leaving early
    (or failing) closes every stream, so whatever each one holds open (a worker request) ends."""
    if len(streams) == 1:  # the common case needs no tasks
        try:
            async for item in streams[0]:
                yield item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(finished)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put(exc)
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is finished:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        await cancel_and_wait(*tasks)
