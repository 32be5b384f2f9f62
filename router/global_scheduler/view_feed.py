"""The global scheduler's inputs as a numbered feed, so copies of its view can follow it (no Ray).

The scheduler actor is the source of truth: it applies every worker's KV event
batches, snapshots and drops. Each ingress replica keeps a copy of the view
(``kv_mirror.SchedulerMirror``) and routes with it, with no call on a
request's path. The copy stays exact because it applies the same inputs in
the same order through the same core: ``ViewFeed`` numbers them (a cursor per
entry, an ``epoch`` per actor incarnation) and keeps the latest
``max_entries``, and no more than ``max_bytes`` of hashes (a snapshot of a large worker's cache
weighs as much as thousands of batches). A follower asks for what came after its cursor; one whose
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

from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.views import WorkerState
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


def entry_bytes(entry: FeedEntry) -> int:
    """The bytes an entry holds that grow with a worker's cache: its hashes (and request ids)."""
    if isinstance(entry, KVEventBatch):
        return len(entry.stored) + len(entry.removed) + sum(map(len, entry.added))
    if isinstance(entry, KVSnapshot):
        return len(entry.block_hashes) + len(entry.in_use_hashes) + sum(map(len, entry.added))
    return len(entry.worker_id)


def slim(batch: KVEventBatch) -> KVEventBatch:
    """The batch as the view needs it: without parent hashes and token ids."""
    if not batch.stored_parents and not batch.stored_token_ids:
        return batch
    return dataclasses.replace(batch, stored_parents=b"", stored_token_ids=b"")


class ViewFeed:
    def __init__(self, epoch: str, max_entries: int = 16384, max_bytes: int = 64 << 20) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"max_entries and max_bytes must be >= 1, got {max_entries}, {max_bytes}")
        self.epoch = epoch
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: deque[FeedEntry] = deque()
        self._sizes: deque[int] = deque()  # entry_bytes of each kept entry
        self._bytes = 0
        self._last = -1  # number of the newest entry

    @property
    def cursor(self) -> int:
        return self._last

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    def append(self, entry: FeedEntry) -> None:
        entry = slim(entry) if isinstance(entry, KVEventBatch) else entry
        size = entry_bytes(entry)
        self._entries.append(entry)
        self._sizes.append(size)
        self._bytes += size
        self._last += 1
        # The newest entry always stays: a follower one entry behind gets it, not the whole view.
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
            self._entries.popleft()
            self._bytes -= self._sizes.popleft()

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
