"""The global scheduler's plain data: a routing request and decision, what it knows of each worker
(``WorkerView``; ``WorkerState``, the same as a new copy of the view starts from), and its
counters. ``core.GlobalScheduler`` keeps and changes them; the ranking walks, the predictions and
admission control's forecast read them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagefleet.router.global_scheduler.ranking_native import WorkerTable


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    block_hashes: bytes  # the prompt's full blocks, packed, as the ingress hashed them
    num_blocks: int  # blocks the request takes over its life on a worker that has none of it cached
    num_seqs: int = 1  # sequences (n)
    max_steps: int = 0  # engine steps it runs at most once started (its max_tokens); 0: not known


@dataclass(slots=True)
class WorkerScore:
    worker_id: str
    cached_blocks: int  # leading prompt blocks it holds (or is predicted to)
    load_blocks: int
    cost: float
    has_room: bool


@dataclass(slots=True)
class RouteDecision:
    ranking: list[str]  # worker ids, best first: those with room; every candidate when none has
    admitted: bool  # some worker has room for the request now
    reason: str  # "prefix" (the first choice holds part of the prompt), "load", "no_room" or "no_workers"
    predicted_hit_blocks: int  # prompt blocks the first choice holds
    scores: list[WorkerScore] = field(default_factory=list)  # in ranking order


@dataclass(slots=True)
class WorkerView:
    """What the scheduler knows of one worker (its blocks, cached and in use, live in the index under ``slot``)."""

    worker_id: str
    slot: int
    last_seen: float
    seq: int = -1  # of the last batch applied; a new view expects batch 0 (a fresh worker)
    synced: bool = True  # False from a sequence gap until a snapshot arrives
    snapshot_asked_at: float | None = None
    reported: bool = False  # has sent its counters at least once
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_reserved_blocks: int = 0
    predicted_blocks: int = 0
    predicted_seqs: int = 0  # sequences of requests routed to it that it has not reported yet
    max_seqs: int = sys.maxsize  # sequences it holds at most, running and waiting (its request queue)
    # When its running sequences end (packed ``Release``s), its step time, and when this view heard
    # them (admission control's forecast of room: ``routing.room_forecast``).
    releases: bytes = b""
    step_time_s: float = 0.0
    releases_at: float = 0.0
    # Derived from the numbers above by ``refresh`` whenever they change (read once per decision):
    load_blocks: int = 0  # committed: in use + reserved by unfinished sequences + predicted
    room_blocks: int = sys.maxsize  # free - reserved - predicted; no bound until the worker reports
    queued: int = 0  # sequences running or waiting
    seats: int = sys.maxsize  # sequences it can still take: max - queued - predicted
    table: WorkerTable | None = field(default=None, repr=False, compare=False)  # the compiled walk's copy of them

    def refresh(self) -> None:
        used = self.num_total_blocks - self.num_free_blocks
        self.load_blocks = used + self.num_reserved_blocks + self.predicted_blocks
        if self.reported:
            self.room_blocks = self.num_free_blocks - self.num_reserved_blocks - self.predicted_blocks
        self.queued = self.num_running + self.num_waiting
        self.seats = self.max_seqs - self.queued - self.predicted_seqs
        if self.table is not None:
            self.table.put(self)


@dataclass(slots=True)
class WorkerState:
    """One worker's whole view, as plain data: what a new copy of the view starts from."""

    worker_id: str
    seq: int
    synced: bool
    routing_keys: bytes  # packed (``kv_index.pack_keys``)
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_reserved_blocks: int
    in_use_keys: bytes = b""  # packed, as routing_keys
    releases: bytes = b""
    step_time_s: float = 0.0


@dataclass(slots=True)
class SchedulerCounters:
    batches: int = 0
    block_events: int = 0  # stored + removed + acquired + released hashes applied
    stale_batches: int = 0  # duplicates or batches from before a snapshot
    gaps: int = 0
    snapshots_asked: int = 0
    snapshots_applied: int = 0
    workers_dropped: int = 0
    decisions: int = 0
    decisions_without_room: int = 0
    decisions_to_wait: int = 0  # admitted to a worker holding more of the prompt that had no room yet
    predictions_confirmed: int = 0
    predictions_expired: int = 0  # ran out before the worker reported the request
    predictions_withdrawn: int = 0  # the request ended at the router before the worker reported it
