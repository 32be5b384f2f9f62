"""Draining every ingress replica before ``pagefleet serve`` stops (SIGTERM, a first Ctrl-C).

A Serve handle sends each call to one replica, and Serve refuses a custom request router on the
ingress deployment behind HAProxy, so the command cannot call each replica itself. It makes a
``DrainBoard`` actor instead and hands it to every ingress replica, which waits on it
(``router.ingress.follow_drain``). On a drain the board tells them all at once: each stops
admitting (new requests 503 ``draining`` with ``Retry-After``, ``/health`` 503) and reports
its requests in flight until none are left; the command waits for that, up to the drain
timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

# How long the replicas have to answer that they stopped admitting (one being replaced has no
# board call waiting until it runs).
FIND_REPLICAS_TIMEOUT_S = 30.0
POLL_S = 0.1


class DrainState(NamedTuple):
    at_start: dict[str, int]  # replica id -> requests in flight when it stopped admitting
    now: dict[str, int]  # replica id -> requests in flight at its last report


class DrainBoard:
    """The Ray actor between ``pagefleet serve`` and its ingress replicas (an async actor: each
    replica's ``wait_for_drain`` call waits on it for as long as the app runs)."""

    def __init__(self) -> None:
        self._draining = asyncio.Event()
        self._at_start: dict[str, int] = {}
        self._now: dict[str, int] = {}

    async def wait_for_drain(self) -> None:
        await self._draining.wait()

    async def drain(self) -> None:
        self._draining.set()

    async def report(self, replica_id: str, num_in_flight: int) -> None:
        self._at_start.setdefault(replica_id, num_in_flight)
        self._now[replica_id] = num_in_flight

    async def state(self) -> DrainState:
        return DrainState(dict(self._at_start), dict(self._now))


class BoardLost(RuntimeError):
    """The ``DrainBoard`` cannot be reached (its node was lost): there is no drain to run."""


class Board(Protocol):
    """The command's side of a ``DrainBoard`` (``RayDrainBoard``; a fake in tests). Its calls raise
    ``BoardLost`` when the board is gone."""

    def drain(self) -> None: ...

    def state(self) -> DrainState: ...


class RayDrainBoard:
    """A ``DrainBoard`` actor, owned by this process (it ends with the command), on this process's
    node where it has room: a board on another node would go with that node."""

    def __init__(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self.actor = ray.remote(num_cpus=0)(DrainBoard).options(scheduling_strategy=here).remote()

    def drain(self) -> None:
        self._get(self.actor.drain.remote())

    def state(self) -> DrainState:
        return self._get(self.actor.state.remote())

    @staticmethod
    def _get(ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise BoardLost(f"{type(exc).__name__}") from exc


class DrainReport(NamedTuple):
    num_replicas: int  # ingress replicas that stopped admitting
    num_in_flight: int  # requests in flight when they did
    num_cut: int  # requests still running when the timeout passed
    seconds: float


def drain_ingress(board: Board, num_replicas: int, timeout_s: float, say: Callable[[str], None] = print,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], Any] = time.sleep) -> DrainReport:
    """Tells the ``num_replicas`` ingress replicas to stop admitting and waits up to ``timeout_s``
    (from now) for their requests in flight; says what it does. Replicas that have not answered
    within ``FIND_REPLICAS_TIMEOUT_S`` are left out, and said so. A board that is lost ends the
    drain there (said so): whatever ran stops with the command."""
    started = clock()
    try:
        return _drain(board, num_replicas, timeout_s, say, clock, sleep, started)
    except BoardLost as exc:
        say(f"pagefleet: the drain board is gone ({exc}); stopping without draining")
        return DrainReport(0, 0, 0, clock() - started)


def _drain(board: Board, num_replicas: int, timeout_s: float, say: Callable[[str], None],
           clock: Callable[[], float], sleep: Callable[[float], Any], started: float) -> DrainReport:
    board.drain()
    state = board.state()
    while len(state.at_start) < num_replicas and clock() - started < FIND_REPLICAS_TIMEOUT_S:
        sleep(POLL_S)
        state = board.state()
    if len(state.at_start) < num_replicas:
        say(f"pagefleet: {len(state.at_start)} of {num_replicas} ingress replicas answered; draining those")
    say(f"pagefleet: draining {sum(state.at_start.values())} requests, up to {timeout_s:g} s")
    while any(state.now.values()) and clock() - started < timeout_s:
        sleep(POLL_S)
        state = board.state()
    num_cut = sum(state.now.values())
    seconds = clock() - started
    if num_cut:
        say(f"pagefleet: {timeout_s:g} s passed, {num_cut} requests cut")
    else:
        say(f"pagefleet: drained in {seconds:.1f} s")
    return DrainReport(len(state.at_start), sum(state.at_start.values()), num_cut, seconds)
