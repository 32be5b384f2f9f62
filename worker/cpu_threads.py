"""How many threads a CPU engine computes with (torch's intra-op pool, OpenMP underneath)."""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, as a container or taskset sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_compute_threads(requested: int | None, cores: int, ranks: int = 1) -> int:
    """``requested`` if given, else every core but one shared evenly among ``ranks`` engine
    ranks on the machine, and at least one.

    One core is left to the processes' other threads (the engine loop's host work, the
    server's event loops, Ray's), as vLLM's CPU backend reserves one for its scheduler:
    a matmul team that spans every core stalls whenever any of them is taken away."""
    if requested is not None:
        return requested
    return max(1, (cores - 1) // ranks)
