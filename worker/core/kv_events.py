"""KV events: what a worker's prefix cache gained and lost, as plain data for the global scheduler.

The block pool records every change to its set of cached hashes in a
``KVEventLog``; the engine drains the log once per step into one
``KVEventBatch`` with the next per-worker sequence number. The log coalesces:
a hash cached and evicted again before a drain never shows up, and one evicted
and cached again shows up as nothing, so it never holds more than the pool's
cached hashes plus those the last batch reported (at most two entries per
block), however long nobody drains it. ``KVSnapshot`` is the whole state at a
sequence number, for a scheduler that missed batches (a gap in the numbers).

Besides which hashes are cached, the log says which of them are in use (held by
a running sequence) and which are idle (free, evictable): a request that reuses
an idle cached prefix takes those blocks out of the free count, one that shares
a prefix in use does not, so a scheduler that counts room exactly needs both.
A stored hash is in use; ``acquired`` and ``released`` report the changes after
that, as the state each hash was last left in.

Hashes travel packed (16 bytes each, concatenated): one bytes object per
batch instead of one per block, so a batch pickles and unpickles at C speed.

Each batch also says when the worker's running sequences will give their blocks
back (``releases``: how many steps each has left at most, and the blocks and
seats its end frees) and how long a step takes: from those, every ingress
replica estimates when a full worker will have room (admission control), with
no guess about requests other ingress replicas sent.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Iterable, NamedTuple, Sequence

from pagefleet.worker.core.block_hash import HASH_SIZE, ROOT_HASH, BlockHash, pack_hashes, unpack_hashes


@dataclass(slots=True)
class KVEventBatch:
    """One engine step's changes to a worker's cached hashes, plus its load.

    A publisher that fell behind may merge consecutive batches into one
    (``first_seq < seq``); it is then the net change over all of them."""

    worker_id: str
    first_seq: int
    seq: int
    cleared: bool  # the worker's cache was emptied before the changes below were made
    stored: bytes = b""  # hashes newly cached, HASH_SIZE bytes each, parents before children
    stored_parents: bytes = b""  # the parent hash of each stored block (ROOT_HASH for a first block)
    stored_token_ids: bytes = b""  # block_size token ids per stored block, int32 little-endian, packed
    removed: bytes = b""  # hashes no longer cached (evicted, or withdrawn after a failed step)
    num_free_blocks: int = 0  # blocks no running sequence holds (cached-but-idle ones included)
    num_total_blocks: int = 0
    num_running: int = 0  # sequences, not requests: an n=4 request is 4
    num_waiting: int = 0
    num_reserved_blocks: int = 0  # blocks unfinished sequences will still take to reach max_tokens
    added: list[str] = field(default_factory=list)  # requests taken in since the previous batch
    acquired: bytes = b""  # cached hashes now in use again (idle before), packed
    released: bytes = b""  # cached hashes now idle (no sequence holds them), packed
    releases: bytes = b""  # when running sequences end and what that frees (``pack_releases``)
    step_time_s: float = 0.0  # the engine's recent step time (0: none measured yet)

    @property
    def num_stored(self) -> int:
        return len(self.stored) // HASH_SIZE

    @property
    def num_removed(self) -> int:
        return len(self.removed) // HASH_SIZE

    def __reduce__(self):
        # Its fields as the constructor's arguments: a slotted dataclass's own pickling restores
        # them in a Python loop, which costs an ingress's copy of the view more than applying the
        # batch (every ingress unpickles every batch).
        return KVEventBatch, _BATCH_FIELDS(self)


_BATCH_FIELDS = attrgetter(*(f.name for f in fields(KVEventBatch)))


@dataclass(slots=True)
class KVSnapshot:
    """Everything a worker has cached, valid right after its batch number ``seq``."""

    worker_id: str
    seq: int
    block_hashes: bytes  # HASH_SIZE bytes each
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_reserved_blocks: int
    added: list[str] = field(default_factory=list)  # as in a batch: requests taken in since the previous one
    in_use_hashes: bytes = b""  # the cached hashes a running sequence holds (the rest are idle)
    releases: bytes = b""  # as in a batch
    step_time_s: float = 0.0


@dataclass(slots=True)
class KVLoad:
    """A worker's load at a drain, as the engine's scheduler sees it."""

    num_running: int = 0
    num_waiting: int = 0
    num_reserved_blocks: int = 0
    releases: bytes = b""  # ``pack_releases``
    step_time_s: float = 0.0


class Release(NamedTuple):
    """Running sequences that end within ``steps`` more engine steps (at most: a stop string or
    EOS may end one sooner), the seats they hold and the blocks their end gives back."""

    steps: int
    seqs: int
    blocks: int


_RELEASE = struct.Struct("<III")


def pack_releases(releases: Iterable[Release]) -> bytes:
    """Releases as little-endian uint32 triples (steps, seqs, blocks), in the order given."""
    return b"".join(_RELEASE.pack(*r) for r in releases)


def unpack_releases(packed: bytes) -> list[Release]:
    return [Release(*r) for r in _RELEASE.iter_unpack(packed)]


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def unpack_token_ids(packed: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(packed) // 4}i", packed))


class KVEventLog:
    """Changes to one pool's cached hashes since the last drain, coalesced per hash.

    The pool guarantees a hash is cached at most once at a time, so for each
    hash the calls alternate stored/removed; that is what makes coalescing exact.
    In-use changes are kept as the state each hash was last left in (setting a
    state the consumer already has is harmless), dropped with the hash.
    """

    __slots__ = ("_stored", "_removed", "_in_use", "_cleared")

    def __init__(self, cleared: bool = True) -> None:
        self._stored: dict[BlockHash, tuple[BlockHash, Sequence[int]]] = {}
        self._removed: dict[BlockHash, None] = {}  # an ordered set
        self._in_use: dict[BlockHash, bool] = {}  # hash -> in use (True) or idle (False) now
        self._cleared = cleared  # a new pool is empty: its first batch tells the scheduler so

    def __len__(self) -> int:
        return len(self._stored) + len(self._removed) + len(self._in_use)

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        if block_hash in self._removed:
            del self._removed[block_hash]  # removed and back again: the consumer still has the hash,
            self._in_use[block_hash] = True  # maybe as idle; it is in use now
        else:
            self._stored[block_hash] = (parent if parent is not None else ROOT_HASH, token_ids)
            self._in_use.pop(block_hash, None)  # stored means in use

    def removed(self, block_hash: BlockHash) -> None:
        self._in_use.pop(block_hash, None)
        if block_hash in self._stored:
            del self._stored[block_hash]  # never reported: nothing to take back
        else:
            self._removed[block_hash] = None

    def acquired(self, block_hash: BlockHash) -> None:
        """An idle cached hash is in use again (a request reuses it)."""
        self._in_use[block_hash] = True

    def released(self, block_hash: BlockHash) -> None:
        """No sequence holds a cached hash any more: it is idle (free, evictable)."""
        self._in_use[block_hash] = False

    def cleared(self) -> None:
        """The pool dropped every cached hash at once."""
        self._stored.clear()
        self._removed.clear()
        self._in_use.clear()
        self._cleared = True

    def drain(self, worker_id: str, seq: int, num_free_blocks: int, num_total_blocks: int,
              load: KVLoad) -> KVEventBatch:
        batch = KVEventBatch(
            worker_id=worker_id, first_seq=seq, seq=seq, cleared=self._cleared,
            stored=pack_hashes(self._stored),
            stored_parents=pack_hashes(parent for parent, _ in self._stored.values()),
            stored_token_ids=pack_token_ids([t for _, ids in self._stored.values() for t in ids]),
            removed=pack_hashes(self._removed),
            num_free_blocks=num_free_blocks, num_total_blocks=num_total_blocks, num_running=load.num_running,
            num_waiting=load.num_waiting, num_reserved_blocks=load.num_reserved_blocks,
            releases=load.releases, step_time_s=load.step_time_s,
            acquired=pack_hashes(h for h, in_use in self._in_use.items() if in_use),
            released=pack_hashes(h for h, in_use in self._in_use.items() if not in_use))
        self._stored = {}
        self._removed = {}
        self._in_use = {}
        self._cleared = False
        return batch


def merge_batches(batches: Sequence[KVEventBatch]) -> KVEventBatch:
    """Consecutive batches of one worker as one: the net change, the last batch's counters.

    What a publisher sends when the scheduler is slower than the steps."""
    if not batches:
        raise ValueError("nothing to merge")
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    for prev, nxt in zip(batches, batches[1:]):
        if nxt.worker_id != first.worker_id or nxt.first_seq != prev.seq + 1:
            raise ValueError(f"batches {prev.worker_id}#{prev.seq} and {nxt.worker_id}#{nxt.first_seq} "
                             "are not consecutive batches of one worker")
    log = KVEventLog(cleared=False)
    for batch in batches:
        if batch.cleared:
            log.cleared()
        for h in unpack_hashes(batch.removed):
            log.removed(h)
        n = batch.num_stored
        if n:
            token_ids = unpack_token_ids(batch.stored_token_ids)
            block_size = len(token_ids) // n
            for i, (h, parent) in enumerate(zip(unpack_hashes(batch.stored), unpack_hashes(batch.stored_parents))):
                log.stored(h, parent, token_ids[i * block_size:(i + 1) * block_size])
        for h in unpack_hashes(batch.acquired):  # the state each hash was left in: after its stored
            log.acquired(h)
        for h in unpack_hashes(batch.released):
            log.released(h)
    last = batches[-1]
    merged = log.drain(first.worker_id, last.seq, last.num_free_blocks, last.num_total_blocks,
                       KVLoad(last.num_running, last.num_waiting, last.num_reserved_blocks, last.releases,
                              last.step_time_s))
    merged.first_seq = first.first_seq
    merged.added = [rid for batch in batches for rid in batch.added]
    return merged


class KVEventSource:
    """Numbers one worker's event batches and answers snapshots that line up with them.

    ``pool`` is the worker's ``BlockPool`` (built with ``events=KVEventLog()``)."""

    def __init__(self, worker_id: str, pool) -> None:
        if pool.events is None:
            raise ValueError("the block pool records no KV events (build it with events=KVEventLog())")
        self.worker_id = worker_id
        self.pool = pool
        self.seq = -1  # of the last batch drained
        self._added: list[str] = []

    def request_added(self, request_id: str) -> None:
        """The engine took a request in: the next batch says so (its blocks now show in the
        worker's own counts, so the scheduler stops predicting them)."""
        self._added.append(request_id)

    def drain(self, load: KVLoad) -> KVEventBatch:
        self.seq += 1
        batch = self.pool.events.drain(self.worker_id, self.seq, self.pool.num_free, self.pool.num_blocks, load)
        batch.added, self._added = self._added, []
        return batch

    def snapshot(self, load: KVLoad) -> tuple[KVEventBatch, KVSnapshot]:
        """The pool's whole state, valid right after a new batch that drains what is pending.
        That batch is returned too: it belongs in the stream like any other (a consumer holding
        the snapshot finds it stale, one that did not ask for the snapshot applies it)."""
        batch = self.drain(load)
        cached = self.pool.cached
        return batch, KVSnapshot(self.worker_id, batch.seq, pack_hashes(cached), self.pool.num_free,
                                 self.pool.num_blocks, load.num_running, load.num_waiting,
                                 load.num_reserved_blocks, batch.added,
                                 pack_hashes(h for h, block in cached.items() if block.ref_cnt > 0),
                                 load.releases, load.step_time_s)
