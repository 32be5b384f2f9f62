"""The global scheduler's core: every worker's KV blocks and load, and where a request should go.

Python (no Ray, no torch, no clock of its own: callers pass ``now``), so
every choice is tested on constructed states; the KV index and the ranking walk
over it are compiled where a C++ compiler is (``kv_index_native``,
``ranking_native``), else pure Python (``kv_index``, ``ranking``), with the same
answers. ``actor.py`` wraps it
in a named Ray actor (the source of truth, fed by the workers); each ingress
replica holds another instance as its read-only copy (``kv_mirror.py``), fed
the same inputs in the same order, and routes with it.

The view of a worker is exact, not guessed: it is the worker's own KV event
batches applied in sequence order. A batch whose first number is not the next
one expected (a dropped or lost batch) makes the view unreliable: the core
asks that worker for a snapshot and ignores its batches until one arrives. A
worker silent for longer than ``liveness_timeout_s`` (workers publish a
heartbeat every few seconds when idle), or reported dead, is dropped with
everything it held.

Routing: a worker's cost for a request is
``weight * (prompt blocks it would compute after its cached prefix) + load``,
where load is the blocks it has committed (held by running sequences, still
to be taken by its unfinished ones up to their ``max_tokens``) plus blocks
predicted for requests just routed to it. A worker has room when its free
blocks, less what is committed or predicted, cover what the request takes out
of them: its new blocks, plus the blocks of its cached prefix that are idle
(free but cached: reusing them takes them out of the free count too; a prefix
some running sequence holds is shared at no cost, unless its holders end
before the request starts: then it counts as taken from that batch on). Which
cached blocks are in use comes from the workers' events like the rest.
A worker also needs a seat for the request's sequences: it holds at most
``max_seqs_per_worker`` running and waiting (its request limit; sequences
routed to it and not yet reported count too), and past that a request would
only wait in Serve's queue for it. When some worker has room, the request is
admitted. A worker that holds more of the prompt than the best worker with room,
and has a seat but no room, ranks beside the workers with room by the same cost.
The request can wait there, queued by that worker's engine until blocks free,
instead of computing that much more of the prompt elsewhere; its load, the
blocks it has committed, says how long the wait may be. Other workers without
room rank only when no worker has room. Then the request is not admitted:
admission control holds it at the router, and refuses at once what its queue
cannot hold.
Predicted blocks end when the worker reports the request taken in; predicted
prefix entries (so a burst with one prefix keeps to one worker) end
``prediction_ttl_s`` after the decision when the worker never reports the
request, else ``prefix_hold_s`` after it does: a long prompt can wait in the
worker's queue and take seconds to compute before its blocks are reported
stored, and a request of the same prefix meanwhile belongs there too
(``predictions.py`` keeps them).
"""

from __future__ import annotations

import heapq
import sys
from array import array
from collections.abc import Callable, Collection, Sequence
from itertools import chain
from operator import attrgetter

from pagefleet.router.global_scheduler.kv_index import KEY_WIDTH, routing_keys
from pagefleet.router.global_scheduler.kv_index_native import NativeKVBlockIndex, new_kv_index
from pagefleet.router.global_scheduler.predictions import Prediction, Predictions
from pagefleet.router.global_scheduler.ranking import RANK, Row, candidate_rows, row, rows_to_wait, slots_of
from pagefleet.router.global_scheduler.ranking_native import NativeWalk, WorkerTable
from pagefleet.router.global_scheduler.views import (
    RouteDecision,
    RouteRequest,
    SchedulerCounters,
    WorkerScore,
    WorkerState,
    WorkerView,
)
from pagefleet.worker.core.block_hash import HASH_SIZE
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot

_PACKED_PARTS = attrgetter("removed", "stored", "acquired", "released")  # a batch's packed hashes (block events)
HoldersOver = Callable[[int], list[tuple[int, int]]]  # cached blocks -> (slot, cached) of those holding more


class GlobalScheduler:
    def __init__(self, *, weight: float = 4.0, prediction_ttl_s: float = 2.0, prefix_hold_s: float = 10.0,
                 liveness_timeout_s: float = 10.0,
                 snapshot_retry_s: float = 2.0, max_ranked: int = 8, max_seqs_per_worker: int | None = None,
                 index_kind: str | None = None) -> None:
        """``max_seqs_per_worker``: how many sequences a worker holds, running and waiting, before
        requests queue for it elsewhere (the worker deployment's request limit); a worker with no
        seat left has no room, as one without the blocks (None: no limit). ``index_kind``: the KV
        index, as ``kv_index_native.new_kv_index`` takes it (default: the compiled one if it builds)."""
        if weight < 0:
            raise ValueError(f"the cost weight must be >= 0, got {weight}")
        if max_ranked < 1:
            raise ValueError(f"max_ranked must be >= 1, got {max_ranked}")
        self.weight = weight
        self.max_ranked = max_ranked
        self.max_seqs_per_worker = sys.maxsize if max_seqs_per_worker is None else max_seqs_per_worker
        if prefix_hold_s < prediction_ttl_s:  # a held entry must not end before an unconfirmed one would
            raise ValueError(f"prefix_hold_s ({prefix_hold_s}) must be >= prediction_ttl_s ({prediction_ttl_s})")
        self.prediction_ttl_s = prediction_ttl_s
        self.prefix_hold_s = prefix_hold_s
        self.liveness_timeout_s = liveness_timeout_s
        self.snapshot_retry_s = snapshot_retry_s
        self.index = new_kv_index(index_kind)
        # The compiled index ranks with the compiled walk, over a table of the views' numbers.
        native = isinstance(self.index, NativeKVBlockIndex)
        self._walk = NativeWalk(self.index, max_ranked) if native else None
        self._table = WorkerTable() if native else None
        self._all_slots: array | None = None  # every view's slot, for the walk; None: to redo (and the id order)
        self.workers: dict[str, WorkerView] = {}
        self._by_slot: dict[int, WorkerView] = {}
        self._order: list[WorkerView] = []  # every view; sorted by ``ranking.RANK`` when a decision starts
        self.counters = SchedulerCounters()
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._next_liveness_check = float("-inf")
        self.predictions = Predictions(NativeKVBlockIndex(self.index.library) if native else None)

    # ---- workers -----------------------------------------------------------------------------

    def _view(self, worker_id: str, now: float) -> WorkerView:
        view = self.workers.get(worker_id)
        if view is None:
            if self._free_slots:
                slot = min(self._free_slots)  # low slots keep bit masks short
                self._free_slots.remove(slot)
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            view = self.workers[worker_id] = self._by_slot[slot] = WorkerView(worker_id, slot, last_seen=now,
                                                                              max_seqs=self.max_seqs_per_worker,
                                                                              table=self._table)
            self._order.append(view)
            if self._table is not None:
                self._table.put(view)
                self._all_slots = None
        return view

    def drop_worker(self, worker_id: str) -> bool:
        """Forget a worker that died or left, with all it held; False if it was unknown."""
        view = self.workers.pop(worker_id, None)
        if view is None:
            return False
        del self._by_slot[view.slot]
        self._order.remove(view)
        self._all_slots = None
        self.index.clear(view.slot)
        for pred in [p for p in self.predictions.by_request.values() if p.slot == view.slot]:
            self.predictions.end(pred, None)
        self._free_slots.append(view.slot)
        self.counters.workers_dropped += 1
        return True

    def expire(self, now: float) -> list[str]:
        """Drop silent workers (looked for at most once a second) and end predictions past their
        time; returns the workers dropped."""
        dropped = []
        if now >= self._next_liveness_check:
            self._next_liveness_check = now + 1.0
            for view in [v for v in self.workers.values() if now - v.last_seen > self.liveness_timeout_s]:
                self.drop_worker(view.worker_id)
                dropped.append(view.worker_id)
        for pred in self.predictions.expired(now):
            if not pred.confirmed:  # the worker never reported the request
                self.counters.predictions_expired += 1
            self.predictions.end(pred, self._view_of(pred))
        return dropped

    def withdraw(self, request_id: str) -> bool:
        """The request ended at the router before its worker reported taking it in (its client went
        away on the way, or it failed): the room predicted taken is not going to be, and a forecast
        would count it for the request's every step. A prediction the worker confirmed stays (its
        prefix hold). True: a prediction was withdrawn."""
        pred = self.predictions.by_request.get(request_id)
        if pred is None or pred.confirmed:
            return False
        self.counters.predictions_withdrawn += 1
        self.predictions.end(pred, self._view_of(pred))
        return True

    def _report(self, view: WorkerView, b: KVEventBatch | KVSnapshot, now: float) -> None:
        self._take_counters(view, b, now)
        self._confirm_added(view, b, now)

    def _take_counters(self, view: WorkerView, b: KVEventBatch | KVSnapshot, now: float) -> None:
        view.last_seen = now
        view.reported = True
        view.num_free_blocks = b.num_free_blocks
        view.num_total_blocks = b.num_total_blocks
        view.num_running = b.num_running
        view.num_waiting = b.num_waiting
        view.num_reserved_blocks = b.num_reserved_blocks
        view.releases, view.step_time_s, view.releases_at = b.releases, b.step_time_s, now
        view.refresh()

    def _confirm_added(self, view: WorkerView, b: KVEventBatch | KVSnapshot, now: float) -> None:
        for request_id in b.added:
            pred = self.predictions.by_request.get(request_id)
            if pred is not None and pred.slot == view.slot and not pred.confirmed:
                self.predictions.confirm(pred, view)
                self.predictions.hold_until(pred, now + self.prefix_hold_s)
                self.counters.predictions_confirmed += 1

    def apply_batch(self, batch: KVEventBatch, now: float) -> bool:
        """Apply one worker's batch; True when the scheduler needs a snapshot from that worker."""
        view = self._view(batch.worker_id, now)
        if batch.seq <= view.seq and view.synced:
            self.counters.stale_batches += 1  # a duplicate, or from before the snapshot we hold
            view.last_seen = now
            return False
        self._report(view, batch, now)
        if view.synced and batch.first_seq != view.seq + 1:
            view.synced = False
            self.counters.gaps += 1
        if not view.synced:
            return self._ask_snapshot(view, now)
        self.index.apply_packed(view.slot, batch.removed, batch.stored, cleared=batch.cleared,
                                acquired=batch.acquired, released=batch.released)
        self.predictions.stop_sharing(view, self.index)
        view.seq = batch.seq
        self.counters.batches += 1
        self.counters.block_events += (batch.num_removed + batch.num_stored
                                       + (len(batch.acquired) + len(batch.released)) // HASH_SIZE)
        return False

    def apply_batches(self, batches: Sequence[KVEventBatch], now: float) -> list[str]:
        """``apply_batch`` of each of ``batches`` in order, to the same view, for less: one call into the
        index for all of them (where no prediction shares a key of theirs: then it must see the index as
        of that batch) and each worker's counters taken once, from its last batch (every batch replaces
        them whole). Returns the workers asked for a snapshot, in order. A malformed batch raises
        ValueError with the view partly updated (a copy then starts again from a whole view)."""
        asked: list[str] = []
        latest: dict[str, KVEventBatch] = {}  # each worker's last batch not stale
        slots: list[int] = []  # the batches to apply to the index, and their slots
        pending: list[KVEventBatch] = []
        views, counters, shares_on = self.workers, self.counters, self.predictions.shares_on
        try:
            for batch in batches:
                view = views.get(batch.worker_id) or self._view(batch.worker_id, now)
                if batch.seq <= view.seq and view.synced:
                    counters.stale_batches += 1
                    view.last_seen = now
                    continue
                latest[batch.worker_id] = batch
                if batch.added:
                    self._confirm_added(view, batch, now)
                if view.synced and batch.first_seq != view.seq + 1:
                    view.synced = False
                    counters.gaps += 1
                if not view.synced:
                    if self._ask_snapshot(view, now):
                        asked.append(view.worker_id)
                    continue
                slots.append(view.slot)
                pending.append(batch)
                view.seq = batch.seq
                if shares_on(view.slot):
                    self._apply_to_index(slots, pending)
                    self.predictions.stop_sharing(view, self.index)
        finally:
            self._apply_to_index(slots, pending)
            for worker_id, batch in latest.items():  # (no view leaves during a run)
                self._take_counters(views[worker_id], batch, now)
        return asked

    def _apply_to_index(self, slots: list[int], batches: list[KVEventBatch]) -> None:
        """``apply_batches``' index work so far, then none left (the lists are emptied)."""
        if not batches:
            return
        try:
            self.index.apply_packed_many(slots, batches)
        finally:
            self.counters.batches += len(batches)
            self.counters.block_events += sum(map(len, chain.from_iterable(map(_PACKED_PARTS, batches)))) // HASH_SIZE
            slots.clear()
            batches.clear()

    def _ask_snapshot(self, view: WorkerView, now: float) -> bool:
        if view.snapshot_asked_at is not None and now - view.snapshot_asked_at < self.snapshot_retry_s:
            return False  # asked already; the snapshot is on its way
        view.snapshot_asked_at = now
        self.counters.snapshots_asked += 1
        return True

    def apply_snapshot(self, snap: KVSnapshot, now: float) -> None:
        view = self._view(snap.worker_id, now)
        if view.synced and snap.seq <= view.seq:
            return  # older than what we hold
        self.index.replace_packed(view.slot, snap.block_hashes)
        self.index.replace_in_use_packed(view.slot, snap.in_use_hashes)
        self._report(view, snap, now)
        self.predictions.stop_sharing(view, self.index)
        view.seq = snap.seq
        view.synced = True
        view.snapshot_asked_at = None
        self.counters.snapshots_applied += 1

    def worker_states(self) -> list[WorkerState]:
        """Every worker's view as plain data, for a new copy of the view to ``restore``."""
        return [WorkerState(v.worker_id, v.seq, v.synced, self.index.packed_keys_of(v.slot), v.num_free_blocks,
                            v.num_total_blocks, v.num_running, v.num_waiting, v.num_reserved_blocks,
                            self.index.packed_in_use_of(v.slot), v.releases, v.step_time_s)
                for v in self.workers.values()]

    def restore(self, states: list[WorkerState], now: float) -> None:
        """Make the view of every worker exactly ``states`` (workers not in it are dropped);
        predictions on workers that stay are kept."""
        keep = {s.worker_id for s in states}
        for worker_id in [w for w in self.workers if w not in keep]:
            self.drop_worker(worker_id)
        for state in states:
            view = self._view(state.worker_id, now)
            self.index.replace_packed(view.slot, state.routing_keys, width=KEY_WIDTH)
            self.index.replace_in_use_packed(view.slot, state.in_use_keys, width=KEY_WIDTH)
            view.seq, view.synced, view.snapshot_asked_at = state.seq, state.synced, None
            view.reported = True
            view.num_free_blocks, view.num_total_blocks = state.num_free_blocks, state.num_total_blocks
            view.num_running, view.num_waiting = state.num_running, state.num_waiting
            view.num_reserved_blocks = state.num_reserved_blocks
            view.releases, view.step_time_s, view.releases_at = state.releases, state.step_time_s, now
            view.refresh()
            self.predictions.stop_sharing(view, self.index)

    def keys_of(self, worker_id: str) -> set[int] | None:
        """The routing keys the scheduler believes the worker holds (None: unknown worker)."""
        view = self.workers.get(worker_id)
        return None if view is None else self.index.keys_of(view.slot)

    def in_use_of(self, worker_id: str) -> set[int] | None:
        """The routing keys the scheduler believes a running sequence of the worker holds."""
        view = self.workers.get(worker_id)
        return None if view is None else self.index.in_use_of(view.slot)

    # ---- routing -----------------------------------------------------------------------------

    def route(self, req: RouteRequest, now: float, candidates: Collection[str] | None = None,
              force: bool = False) -> RouteDecision:
        """Rank ``candidates`` (default: every known worker) for ``req``; the ranking holds
        the best ``max_ranked``.

        The first choice is recorded as a prediction when the request is admitted, or
        always with ``force`` (the caller routes it whether or not a worker has room)."""
        self.expire(now)
        order = self._order if candidates is None else [self._view(c, now) for c in dict.fromkeys(candidates)]
        if not order:
            return RouteDecision([], False, "no_workers", 0)
        keys = routing_keys(req.block_hashes)
        need, seqs = req.num_blocks, req.num_seqs
        everyone = candidates is None
        walk = self._walk_python if self._walk is None else self._walk_compiled
        rows, holders = walk(req, keys, order, everyone)
        best = heapq.nsmallest(self.max_ranked, rows)
        admitted = not best[0][0]
        waiting: set[str] = set()
        if admitted:
            best = [row for row in best if not row[0]]
            extra = [] if best[0][5] >= len(keys) else rows_to_wait(
                holders(best[0][5]), self._by_slot, weight=self.weight, num_keys=len(keys), seqs=seqs,
                ranked={row[4] for row in best}, allowed=None if everyone else {v.slot for v in order})
            if extra:
                waiting = {row[4] for row in extra}
                best = heapq.nsmallest(self.max_ranked, best + extra)
        scores = [WorkerScore(wid, cached, load, cost, not full and wid not in waiting)
                  for full, cost, load, _, wid, cached in best]
        first = scores[0]
        reason = "no_room" if not admitted else ("prefix" if first.cached_blocks else "load")
        self.counters.decisions += 1
        if not admitted:
            self.counters.decisions_without_room += 1
        elif first.worker_id in waiting:
            self.counters.decisions_to_wait += 1
        if admitted or force:
            # It will compute the rest of the prompt there and take the idle blocks of its prefix:
            # both are predicted in use (a request close behind finds them taken, not idle).
            view = self.workers[first.worker_id]
            old = self.predictions.by_request.get(req.request_id)
            if old is not None:  # routed again (a retry): its earlier prediction ends
                self.predictions.end(old, self._view_of(old))
            idle, shared = self.predictions.cached_keys(view, keys, first.cached_blocks, self.index)
            self.predictions.add(Prediction(req.request_id, view.worker_id, view.slot, now + self.prediction_ttl_s,
                                            keys[first.cached_blocks:], max(need - first.cached_blocks, 0) + len(idle),
                                            seqs, idle, shared, steps=req.max_steps, made_at=now), view)
        return RouteDecision([s.worker_id for s in scores], admitted, reason, first.cached_blocks, scores)

    def _idle_count(self, view: WorkerView, keys: list[int], cached: int) -> int:
        """How many of the prompt's first ``cached`` blocks are idle on ``view`` (reusing them takes room)."""
        return len(self.predictions.cached_keys(view, keys, cached, self.index)[0])

    def _walk_python(self, req: RouteRequest, keys: list[int], order: list[WorkerView],
                     everyone: bool) -> tuple[list[Row], HoldersOver]:
        """The rows that can make the ranking (``ranking.candidate_rows``), for the pure-Python index,
        and the prompt's holders of more than a given number of blocks, as (slot, cached)."""
        order.sort(key=RANK)  # every view's is nearly sorted already: a decision or a batch moves one or two
        # {leading prompt blocks held: bit mask of the workers holding that many}
        runs = self.index.prefix_runs(keys, self.predictions.held) if keys else {}
        rows = candidate_rows(order, runs, self._by_slot if everyone else {v.slot: v for v in order},
                              restrict=not everyone, weight=self.weight, num_keys=len(keys), need=req.num_blocks,
                              seqs=req.num_seqs, k=self.max_ranked,
                              idle_count=lambda v, cached: self._idle_count(v, keys, cached))

        def holders(over: int) -> list[tuple[int, int]]:
            return [(slot, run) for run, mask in runs.items() if run > over for slot in slots_of(mask)]

        return rows, holders

    def _walk_compiled(self, req: RouteRequest, keys: list[int], order: list[WorkerView],
                       everyone: bool) -> tuple[list[Row], HoldersOver]:
        """The best rows (``ranking_native``), for the compiled index: no Python loop over the workers;
        and the prompt's holders, as ``_walk_python`` gives them."""
        if self._all_slots is None:  # workers came or went
            self._all_slots = array("I", sorted(self._by_slot))
            self._table.order_ids(self.workers.values())
        slots = self._all_slots if everyone else array("I", [v.slot for v in order])
        num_runs = (self.index.prefix_run_pairs(req.block_hashes, HASH_SIZE, keys, self.predictions.held_index)
                    if keys else 0)
        by_slot = self._by_slot
        best = self._walk.best(self._table, slots, self.index, num_runs, num_keys=len(keys), need=req.num_blocks,
                               seqs=req.num_seqs, weight=self.weight, k=self.max_ranked,
                               idle_count=lambda slot, cached: self._idle_count(by_slot[slot], keys, cached))
        weight, num_keys = self.weight, len(keys)
        rows = [row(no_room, by_slot[slot], cached, weight, num_keys) for slot, cached, no_room in best]
        index = self.index

        def holders(over: int) -> list[tuple[int, int]]:
            # the index's answer to prefix_run_pairs above: nothing has asked it another since
            return [(slot, run) for slot, run in zip(index.run_slots[:num_runs], index.run_lengths[:num_runs])
                    if run > over]

        return rows, holders

    def _view_of(self, pred: Prediction) -> WorkerView | None:
        """The view a prediction was made on, if that worker is still known in that slot."""
        view = self.workers.get(pred.worker_id)
        return view if view is not None and view.slot == pred.slot else None
