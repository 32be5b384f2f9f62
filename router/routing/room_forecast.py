"""When a full fleet will have room: admission control's estimate of each waiting request's wait.

Each worker's KV events say, for its running sequences, how many steps each has left at
most, the blocks and seats its end gives back, and the worker's step time
(``worker.core.worker_load``). So from an ingress's copy of the view, a worker's room at a
later time is its room now (free blocks less those committed and predicted; its seats) plus
what the sequences ending by then give back. No ingress guesses what the others sent: their
requests are in the workers' own numbers once taken in. Requests this ingress routed that a
worker has not reported yet count as its predictions do: their room is taken, and comes back
their ``max_tokens`` steps after they were routed; those this ingress cut short (their
client went away) after their worker took them in give it back once the abort lands, a step
later, until a batch shows it. The requests waiting in this
ingress's queue take that room first come first served, each on the worker with room for it
soonest; a request's forecast wait is when its turn comes.

A release counts from when the batch announcing it reached this copy, plus ``lag_s``: room
shows in the copy that long after it frees (a worker publishes at most every 200 ms, the copy
follows the feed at most every 100 ms). A release whose time has passed without a batch
reporting it (the worker or the feed runs late) is expected within one more lag, at every
forecast until a batch reports it; so a waiting request that only such releases would
admit is refused once less than the lag is left of its wait, not after it.

Pure functions over the views (no clock: callers pass ``now``).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagefleet.router.global_scheduler.predictions import Prediction
from pagefleet.router.global_scheduler.views import WorkerView
from pagefleet.worker.core.kv_events import unpack_releases


@dataclass(slots=True, frozen=True)
class Need:
    """What a request takes out of a worker's room: blocks (at its peak, nothing cached) and seats."""

    blocks: int
    seqs: int = 1


@dataclass(slots=True, frozen=True)
class CutShort:
    """A request an ingress ended (its client went away, it failed) while its worker ran it: the
    worker frees its room when the abort lands, but the view shows that only with a later batch."""

    worker_id: str
    at: float  # when the ingress ended it
    blocks: int  # its blocks at their peak (as ``Need``)
    seqs: int


@dataclass(slots=True)
class Outlook:
    """One worker's room now and what it gains later: ``at`` seconds from now (ascending), the
    blocks and seats gained by then in all (running sums)."""

    room_blocks: int
    seats: int
    at: list[float] = field(default_factory=list)
    blocks_by: list[int] = field(default_factory=list)
    seats_by: list[int] = field(default_factory=list)


def outlook(view: WorkerView, now: float, lag_s: float, routed: Iterable[Prediction] = (),
            cut_short: Iterable[CutShort] = ()) -> Outlook:
    """``view``'s room now and its releases still due, in seconds from ``now``. ``routed``: the
    requests this ingress routed there that the worker has not reported yet (their room is
    predicted taken): each gives it back ``steps`` steps after it was routed, plus the lag.
    ``cut_short``: requests the view still shows running there that this ingress ended early:
    each gives its room back one step after it ended, plus the lag."""
    out = Outlook(view.room_blocks, view.seats)
    if view.step_time_s <= 0:
        return out  # no step measured yet: when its sequences end is unknown, so nothing is counted
    step = view.step_time_s
    due = [(view.releases_at + r.steps * step + lag_s - now, r.seqs, r.blocks) for r in unpack_releases(view.releases)]
    due += [(p.made_at + p.steps * step + lag_s - now, p.seqs, p.blocks) for p in routed if p.steps > 0]
    due += [(c.at + step + lag_s - now, c.seqs, c.blocks) for c in cut_short]
    blocks = seats = 0
    # Overdue (not shown when it should have been: the worker or the feed runs late): expected
    # within one more lag, and so on at every forecast until a batch reports it.
    for at, seqs, freed in sorted((at if at >= 0 else lag_s, seqs, freed) for at, seqs, freed in due):
        blocks += freed
        seats += seqs
        out.at.append(at)
        out.blocks_by.append(blocks)
        out.seats_by.append(seats)
    return out


def forecast_waits(outlooks: Iterable[Outlook], needs: Sequence[Need]) -> list[float]:
    """Each need's wait in seconds, in queue order: placed first come first served (none starts
    before the one ahead of it), each on the worker whose room covers it soonest (the first
    such worker on a tie), where it then takes that room. ``math.inf``: no worker's room
    covers it with the releases known, nor does any need's after it."""
    workers = list(outlooks)
    taken_blocks = [0] * len(workers)
    taken_seats = [0] * len(workers)
    waits: list[float] = []
    earliest = 0.0
    for need in needs:
        best, best_at = -1, math.inf
        for i, w in enumerate(workers):
            at = _room_at(w, need.blocks + taken_blocks[i] - w.room_blocks, need.seqs + taken_seats[i] - w.seats)
            if at < best_at:
                best, best_at = i, at
        if best < 0:
            waits.extend([math.inf] * (len(needs) - len(waits)))
            return waits
        taken_blocks[best] += need.blocks
        taken_seats[best] += need.seqs
        earliest = max(earliest, best_at)
        waits.append(earliest)
    return waits


def _room_at(w: Outlook, blocks_short: int, seats_short: int) -> float:
    """When ``w`` has gained ``blocks_short`` blocks and ``seats_short`` seats (0: has them now)."""
    if blocks_short <= 0 and seats_short <= 0:
        return 0.0
    i = max(bisect_left(w.blocks_by, blocks_short) if blocks_short > 0 else 0,
            bisect_left(w.seats_by, seats_short) if seats_short > 0 else 0)
    return w.at[i] if i < len(w.at) else math.inf
