"""asyncio helpers shared by the worker replica and the ingress."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(*tasks: asyncio.Future | None) -> None:
    """Cancel ``tasks`` (None: nothing to stop) and wait until each has ended, whatever its outcome."""
    running = [task for task in tasks if task is not None]
    if not running:
        return
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
