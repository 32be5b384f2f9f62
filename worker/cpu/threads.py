"""How many threads a CPU engine computes with (torch's intra-op pool, OpenMP underneath)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Mapping

logger = logging.getLogger(__name__)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, as a container or taskset sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_compute_threads(requested: int | None, cores: int, ranks: int = 1) -> int:
    """``requested`` if given, else the cores shared evenly among ``ranks`` engine ranks on the
    machine, and at least one.

    No core is kept back for the processes' other threads (the server's event loops, Ray's):
    a served engine computes at the lowest priority (``yield_cpu_to_serving_threads``), so
    those threads take a core the moment they have work and hand it back when done, instead
    of owning one that sits idle between requests."""
    if requested is not None:
        return requested
    return max(1, cores // ranks)


# The lowest priority a thread can give itself (Linux nice values run -20..19).
LOWEST_NICE = 19


# libgomp's spin-wait before a waiting OpenMP thread sleeps (its count of polls; libgomp's own default
# when no OMP_WAIT_POLICY is set, a few milliseconds). ``pagefleet serve`` runs Ray's processes with
# OMP_WAIT_POLICY=PASSIVE (no spin: where several engines or torch users share the cores, a spinning
# team holds cores another one needs), and gives this back to an engine whose team has its cores to itself.
SPIN_WAIT_ENV = {"GOMP_SPINCOUNT": "300000"}


def libgomp_spins(environ: Mapping[str, str]) -> bool:
    """Whether libgomp, loaded in a process with this environment, spins before a waiting thread
    sleeps: GOMP_SPINCOUNT decides when set, else any OMP_WAIT_POLICY but PASSIVE (unset spins)."""
    if "GOMP_SPINCOUNT" in environ:
        return environ["GOMP_SPINCOUNT"].strip() not in ("", "0")
    return environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"


def compute_thread_env(threads: int, cores: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Environment for a CPU engine's process (read by libgomp when torch loads, so it goes in the
    process's environment at start: a Ray ``runtime_env``): ``SPIN_WAIT_ENV`` when the engine
    computes on ``threads`` == ``cores`` threads (one rank with every core: the team
    ``pin_compute_threads`` pins), else {}; {} too where the user set libgomp's spin themselves.

    A passive team sleeps at the end of every parallel region, and the next region waits for it to
    be woken: on a virtual machine a sleeping vCPU is handed back to the host and its wake-up can
    take long, and meanwhile the server's own threads fill the core. Spinning at the engine's
    lowest priority keeps the core and still yields it the moment a server thread wakes (figures
    in docs/cpu_engine.md)."""
    if threads < 2 or threads != cores or "GOMP_SPINCOUNT" in environ or \
            environ.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE":
        return {}
    return dict(SPIN_WAIT_ENV)


def yield_cpu_to_serving_threads() -> None:
    """Give the calling thread, a served CPU engine's compute thread, the lowest scheduling
    priority (nice 19); the OpenMP team it starts later inherits it.

    On a CPU box the serving path (HTTP proxy, ingress, scheduler, the replica's own event loop)
    shares the cores with the matmuls, and Ray starts every worker process at one niceness
    (15 by default, 0 on pagefleet's clusters: ``serve_env.WORKER_PRIORITY_ENV``). At equal
    priority a busy engine delays each request's parse, route and 429 by whole scheduler slices;
    at the lowest, a step waits only while those short tasks run. Lowering one's own priority
    needs no privilege."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_NICE)  # Linux: this thread only
    except (AttributeError, OSError) as e:  # no per-thread priority on this platform
        logger.warning("could not lower the engine thread's priority: %s", e)


def prepare_engine_thread(compute_threads: int | None) -> dict[int, int]:
    """Make the calling thread a served CPU engine's step thread, before the engine is built on
    it: torch computes with ``compute_threads`` (None: torch's count as it is), the thread takes
    the lowest priority (``yield_cpu_to_serving_threads``) and starts its OpenMP team here, which
    inherits that priority and is pinned (``pin_compute_threads``). Returns what was pinned.

    The engine must then be built on this thread too, and nothing else in the process compute:
    libgomp keeps one thread pool per thread that starts a parallel region, and once its pools
    hold more threads than the process has cores its barriers spin at most 100 times (1,000
    under OMP_WAIT_POLICY=ACTIVE, none under PASSIVE; GOMP_SPINCOUNT can only lower that), so
    each of a step's hundreds of regions ends with its threads asleep on a futex and begins with
    waking them. An engine built on another thread (loading and packing the weights are parallel
    regions: that thread's pool) and stepped on this one would have two pools
    (figures in docs/cpu_engine.md)."""
    import torch

    if compute_threads is not None:
        torch.set_num_threads(compute_threads)
    yield_cpu_to_serving_threads()
    return pin_compute_threads()  # after: the team inherits the priority


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def pin_compute_threads() -> dict[int, int]:
    """Give the calling thread (an engine's step thread) and the OpenMP team it starts one core
    each, when they are as many as the cores this process may use (one worker replica of one
    rank: `pagefleet serve`'s default; several replicas or ranks on a node share its cores and
    are left free). Returns thread id -> core ({} where nothing was pinned: fewer threads than
    cores, one core, a team this thread had started already, or a platform or process that
    does not allow it).

    Call it before the thread computes anything (``prepare_engine_thread``); the team is started
    here, by a parallel region over every thread. A step is a series of parallel regions, each
    ending at a barrier. Left free, the scheduler sometimes puts two of the team on one core (a
    waking OpenMP thread goes where its waker runs when its own core is busy) and the step then
    advances at the pace of the one waiting for its turn. Pinned, each keeps its own core and
    waits only for what runs there (figures in docs/cpu_engine.md)."""
    import torch

    if not hasattr(os, "sched_setaffinity"):
        return {}
    cores = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    if threads < 2 or threads != len(cores):
        return {}
    pinned: dict[int, int] = {}
    try:
        before = _thread_ids()
        torch.ones(threads * (1 << 16)).add_(1.0)  # a parallel region over every thread: the team starts
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        # The team inherits this thread's priority; a thread another one started meanwhile need not.
        team = sorted(tid for tid in _thread_ids() - before if os.getpriority(os.PRIO_PROCESS, tid) == mine)
        if len(team) != threads - 1:
            logger.info("engine threads not pinned: %d new OpenMP threads, expected %d (a team started "
                        "before this thread's first step?)", len(team), threads - 1)
            return {}
        for tid, core in zip([threading.get_native_id(), *team], cores):
            os.sched_setaffinity(tid, {core})
            pinned[tid] = core
    except Exception as e:  # pinning is an optimisation: the engine computes unpinned instead
        for tid in pinned:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, set(cores))
        logger.warning("could not pin the engine's compute threads to cores: %s", e)
        return {}
    return pinned
