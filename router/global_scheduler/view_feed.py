"""The global scheduler's inputs as a numbered feed, so copies of its view can follow it (no Ray).

The scheduler actor is the source of truth: it applies every worker's KV event
batches, snapshots and drops. Each ingress replica keeps a copy of the view
(``kv_mirror.SchedulerMirror``) and routes with it, with no call on a
request's path. The copy stays exact because it applies the same inputs in
the same order through the same core: ``ViewFeed`` numbers them (a cursor per
entry, an ``epoch`` per actor incarnation) and keeps the latest
``max_entries``. A follower asks for what came after its cursor; one whose
cursor is from another epoch (the actor restarted) or fell out of the log gets
the whole view first (``WorkerState`` per worker), then the entries after it.

Entries are the inputs themselves, slimmed: a batch without the parent hashes
and token ids that only a worker-side consumer would want (the core reads
neither), a snapshot as it came, a ``WorkerDropped`` for a worker the actor
forgot (reported dead, or silent past its liveness timeout).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Union

from pagefleet.router.global_scheduler.core import GlobalScheduler, WorkerState
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot


@dataclass(slots=True)
class WorkerDropped:
    worker_id: str


FeedEntry = Union[KVEventBatch, KVSnapshot, WorkerDropped]


@dataclass(slots=True)
class ViewUpdate:
    """What a follower applies, in order: ``states`` (when given: the whole view, replacing its
    own), then ``entries``; afterwards its cursor is ``cursor``."""

    epoch: str
    cursor: int  # number of the last entry included (-1: none yet)
    entries: list = field(default_factory=list)
    states: list[WorkerState] | None = None


def slim(batch: KVEventBatch) -> KVEventBatch:
    """The batch as the view needs it: without parent hashes and token ids."""
    if not batch.stored_parents and not batch.stored_token_ids:
        return batch
    return dataclasses.replace(batch, stored_parents=b"", stored_token_ids=b"")


class ViewFeed:
    def __init__(self, epoch: str, max_entries: int = 16384) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.epoch = epoch
        self._entries: deque[FeedEntry] = deque(maxlen=max_entries)
        self._last = -1  # number of the newest entry

    @property
    def cursor(self) -> int:
        return self._last

    def append(self, entry: FeedEntry) -> None:
        self._entries.append(slim(entry) if isinstance(entry, KVEventBatch) else entry)
        self._last += 1

    def has_news(self, epoch: str | None, cursor: int) -> bool:
        """Whether ``update_since`` would give this follower anything."""
        return epoch != self.epoch or cursor != self._last

    def update_since(self, epoch: str | None, cursor: int, core: GlobalScheduler) -> ViewUpdate:
        """What a follower at (``epoch``, ``cursor``) lacks; ``core`` is the view the feed's
        entries were applied to, for a follower that needs all of it."""
        first_kept = self._last - len(self._entries) + 1
        if epoch == self.epoch and first_kept - 1 <= cursor <= self._last:
            entries = list(islice(reversed(self._entries), self._last - cursor))  # the newest, from the end
            entries.reverse()
            return ViewUpdate(self.epoch, self._last, entries)
        return ViewUpdate(self.epoch, self._last, [], core.worker_states())
