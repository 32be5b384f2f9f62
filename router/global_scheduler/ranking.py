"""Which workers can make a routing decision's ranking: the global scheduler's scoring walk.

A worker's row for a request is ``(no room, cost, load, queue, id, cached)``, compared as a
tuple (``core.GlobalScheduler.route`` keeps the best ``k``), where
``cost = weight * (prompt blocks after its cached prefix) + load``. Workers holding the same
number of prompt blocks (one *group*, from ``KVBlockIndex.prefix_runs``) differ in cost by their
load alone, so with the workers sorted by ``RANK`` each group's best rows come first: the walk
takes a group's first ``k`` with room (rows without room only while no worker has any) and stops
once every group has them or has no worker left to show. Groups of at most ``k`` workers are
looked at directly. At 256 workers this scores a handful instead of every one
(``docs/scaling.md``).

Pure Python; the views are ``views.WorkerView``s. This is the walk of the pure-Python index; with
the compiled one, ``ranking_native`` gives the same best rows in one call.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from pagefleet.router.global_scheduler.views import WorkerView

# The order the walk takes the workers in: least loaded first (what decides among workers
# holding as much of the prompt), then the shorter queue, then the id.
RANK = attrgetter("load_blocks", "queued", "worker_id")
_ROOM = attrgetter("room_blocks")

Row = tuple[bool, float, int, int, str, int]


def row(full: bool, v: WorkerView, cached: int, weight: float, num_keys: int) -> Row:
    """``v``'s row for a prompt of ``num_keys`` blocks of which it holds the first ``cached``."""
    return full, weight * (num_keys - cached) + v.load_blocks, v.load_blocks, v.queued, v.worker_id, cached


def slots_of(mask: int) -> Iterator[int]:
    """The slots of a bit mask, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def rows_to_wait(holders: Iterable[tuple[int, int]], by_slot: dict[int, WorkerView], *, weight: float,
                 num_keys: int, seqs: int, ranked: set[str], allowed: set[int] | None) -> list[Row]:
    """Rows for ``holders`` ((slot, cached blocks): those holding more of the prompt than the best
    worker with room) that are not ``ranked`` yet, with a seat but no room: the request can wait
    there (the worker's engine queues it until blocks free) instead of computing that much more
    of the prompt elsewhere. They rank with the workers that have room by the same cost, their
    load counting what they hold. ``allowed``: the candidates' slots (None: every worker)."""
    out: list[Row] = []
    for slot, cached in holders:
        v = by_slot.get(slot)
        if v is not None and v.worker_id not in ranked and v.seats >= seqs and (allowed is None or slot in allowed):
            out.append(row(False, v, cached, weight, num_keys))
    return out


def candidate_rows(order: list[WorkerView], runs: dict[int, int], by_slot: dict[int, WorkerView], *,
                   restrict: bool, weight: float, num_keys: int, need: int, seqs: int, k: int,
                   idle_count: Callable[[WorkerView, int], int]) -> list[Row]:
    """The rows that can make the best ``k`` for a request of ``need`` blocks and ``seqs``
    sequences whose prompt has ``num_keys`` blocks: ``order`` is every candidate, sorted by
    ``RANK``; ``runs`` the prefix groups (``{cached blocks: bit mask of slots}``), limited to the
    slots of ``by_slot`` when ``restrict``; ``idle_count(view, cached)`` how many of the cached
    blocks are idle there (reusing them takes room), asked only where the answer depends on it."""
    groups = list(runs.items())
    if restrict:
        among = 0
        for slot in by_slot:
            among |= 1 << slot
        groups = [(run, mask & among) for run, mask in groups]
    left = {run: mask.bit_count() for run, mask in groups}  # workers of each group not yet walked
    left[0] = len(order) - sum(left.values())
    with_room = dict.fromkeys(left, 0)
    without_room = dict(with_room)
    room_seen = False
    rows: list[Row] = []

    def add_row(v: WorkerView, cached: int) -> None:
        """``v``'s row joins ``rows`` if it could make the ranking."""
        nonlocal room_seen
        # It needs room for its new blocks and the idle ones of its prefix.
        room = v.room_blocks
        if v.seats < seqs:
            full = True
        elif room >= need:
            full = False
        elif room < need - cached:
            full = True
        else:
            full = room < need - cached + idle_count(v, cached)
        if full:
            if room_seen or without_room[cached] == k:
                return
            without_room[cached] += 1
        else:
            room_seen = True
            with_room[cached] += 1
        rows.append(row(full, v, cached, weight, num_keys))

    walked = []  # groups of more than k workers: found in the walk
    closed = 0  # bit mask of the workers of groups that are done (the small ones from the start)
    for run, mask in groups:
        if left[run] > k:
            walked.append((run, mask))
            continue
        closed |= mask
        for slot in slots_of(mask):
            add_row(by_slot[slot], run)
    zero_done = not left[0]  # group 0: the workers holding none of the prompt
    # No worker has room when even the most cached prefix leaves more new blocks than the
    # largest room (a check at C speed): then each group's first k rows are all it can give.
    hopeless = max(map(_ROOM, order)) < need - max(runs, default=0)
    open_groups = len(walked) + (not zero_done)
    for v in order if open_groups else ():
        slot = v.slot
        if closed >> slot & 1:
            continue
        for run, mask in walked:
            if mask >> slot & 1:
                cached = run
                break
        else:
            if zero_done:
                continue
            cached = 0
        left[cached] -= 1
        # add_row's first test inline (most walked workers fail it): no room, and a row without
        # room could not make the ranking.
        if not ((v.seats < seqs or v.room_blocks < need - cached) and (room_seen or without_room[cached] == k)):
            add_row(v, cached)
        if with_room[cached] == k or not left[cached] or (hopeless and without_room[cached] == k):
            if cached:
                closed |= runs[cached]
            else:
                zero_done = True
            open_groups -= 1
            if not open_groups:
                break
    return rows
