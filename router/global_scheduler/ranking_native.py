"""The routing decision's ranking walk compiled: ``ranking.candidate_rows``'s best rows in one call.

The walk (``ranking_native.cpp``, built into the compiled index's library) reads each worker's
numbers from a ``WorkerTable`` that the views keep current (``views.WorkerView.refresh``) and the
prompt's prefix runs from the index's own buffers, so a decision has no Python loop over the
workers: it pops candidates cheapest first and stops at the best ``k`` with room. Where a
worker's room depends on how many of its cached blocks are idle, it calls back for that count
(only for workers it pops).
"""

from __future__ import annotations

import ctypes
from array import array
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Iterable

from pagefleet.router.global_scheduler.kv_index_native import IDLE_COUNT, NativeKVBlockIndex

if TYPE_CHECKING:
    from pagefleet.router.global_scheduler.views import WorkerView

FIELDS = 5  # per slot, as ranking_native.cpp's Field: load, queued, room, seats, id order
_ID = attrgetter("worker_id")


class WorkerTable:
    """Per slot, the numbers the compiled walk ranks a worker view by: ``ranking.RANK``'s (load, queue,
    id order) and its room and seats."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values = array("q")

    def put(self, view: WorkerView) -> None:
        at = view.slot * FIELDS
        values = self.values
        if at >= len(values):
            values.extend(bytes(8 * (at + FIELDS - len(values))))
        values[at] = view.load_blocks
        values[at + 1] = view.queued
        values[at + 2] = view.room_blocks
        values[at + 3] = view.seats

    def order_ids(self, views: Iterable[WorkerView]) -> None:
        """Number the views' ids in ``str`` order (the last tie-break of a ranking)."""
        values = self.values
        for order, view in enumerate(sorted(views, key=_ID)):
            values[view.slot * FIELDS + 4] = order


class NativeWalk:
    """``ranking.candidate_rows`` over a compiled index's prefix runs, in C++."""

    __slots__ = ("_lib", "_idle", "_error", "_callback", "_slots", "_cached", "_no_room")

    def __init__(self, index: NativeKVBlockIndex, max_ranked: int) -> None:
        self._lib = index.library
        self._idle: Callable[[int, int], int] | None = None  # the current decision's idle_count
        self._error: BaseException | None = None
        self._callback = IDLE_COUNT(self._idle_count)  # kept: C holds a pointer to it
        # the answer's rows
        self._slots, self._cached = (ctypes.c_uint32 * max_ranked)(), (ctypes.c_uint32 * max_ranked)()
        self._no_room = (ctypes.c_uint8 * max_ranked)()

    def _idle_count(self, slot: int, cached: int) -> int:
        try:
            return self._idle(slot, cached)
        except BaseException as exc:  # raised again once the C call is back (a callback cannot raise through C)
            self._error = exc
            return -1

    def best(self, table: WorkerTable, candidates: array, index: NativeKVBlockIndex, num_runs: int, *,
             num_keys: int, need: int, seqs: int, weight: float, k: int,
             idle_count: Callable[[int, int], int]) -> list[tuple[int, int, bool]]:
        """The best ``k`` rows as (slot, cached blocks, no room), best first: those with room, or the
        first ``k`` when none has. ``candidates``: slots (``array('I')``); the prefix runs are the
        index's last ``prefix_run_pairs`` (``num_runs`` of them); ``idle_count(slot, cached)``: how
        many of the slot's first ``cached`` prompt blocks are idle there."""
        if k > len(self._slots):
            raise ValueError(f"this walk ranks at most {len(self._slots)} workers, not {k}")
        self._idle, self._error = idle_count, None
        try:
            n = self._lib.rank_best(table.values.buffer_info()[0], candidates.buffer_info()[0], len(candidates),
                                    index.run_slots, index.run_lengths, num_runs, num_keys, need, seqs, weight, k,
                                    self._callback, self._slots, self._cached, self._no_room)
        finally:
            self._idle = None
        if n < 0:
            raise self._error
        return list(zip(self._slots[:n], self._cached[:n], map(bool, self._no_room[:n])))
