"""What the global scheduler expects of requests it has just routed, until their workers report them.

A worker reports a request it took in with its next batch; until then the
scheduler's view of that worker lacks it, and a burst routed meanwhile would all
land where the view looked emptiest. So each routed request leaves a
``Prediction`` on its worker's view:

- the blocks it will take out of the free count (its new blocks, and the idle
  cached blocks of its prefix it will reuse) and its sequences: counted in the
  view's ``predicted_blocks`` and ``predicted_seqs`` (room and seats) until the
  worker confirms the request;
- the idle keys it will reuse, as "soon in use", so that a request close behind
  with the same prefix shares them instead of counting them idle again;
- the cached keys it shares with requests holding them, at no cost while they
  stay in use: one that goes idle or leaves the cache before confirmation
  becomes a block the first sharer takes (``stop_sharing``);
- the prompt keys it will compute there (``held``, read by the index's prefix
  match), so a burst with one prefix keeps to one worker; these stay until the
  prediction's time runs out, confirmed or not.

Pure Python, no clock of its own; the views (``views.WorkerView``) and the
KV index (what each worker caches and has in use) are passed in.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import not_, sub
from typing import TYPE_CHECKING

from pagefleet.router.global_scheduler.kv_index import KVBlockIndex, holders_mask

if TYPE_CHECKING:
    from pagefleet.router.global_scheduler.kv_index_native import NativeKVBlockIndex
    from pagefleet.router.global_scheduler.views import WorkerView


@dataclass(slots=True)
class Prediction:
    request_id: str
    worker_id: str
    slot: int
    expires: float
    keys: list[int]  # the prompt's keys it will compute there
    blocks: int  # taken out of the worker's free count; 0 once the worker confirmed the request
    seqs: int  # its sequences (n); 0 once confirmed
    idle_keys: list[int] = field(default_factory=list)  # idle cached keys it will take; [] once confirmed
    shared_keys: list[int] = field(default_factory=list)  # cached keys in use it shares; [] once confirmed
    steps: int = 0  # engine steps the request runs at most once started (0: not known)
    made_at: float = 0.0  # when it was routed

    @property
    def confirmed(self) -> bool:
        return not self.seqs


class Predictions:
    def __init__(self, held_index: NativeKVBlockIndex | None = None) -> None:
        """``held_index``: an empty compiled index to hold the predicted (slot, key) pairs in, for the
        compiled index's prefix match, instead of ``held`` (a dict of hundreds of thousands of keys
        is slow to probe from Python: each probe misses the CPU caches)."""
        self.by_request: dict[str, Prediction] = {}
        # (expires, prediction) in expiry order: one queue of the decisions' ttl, one of the
        # holds that confirmations start (each a constant time, so each queue stays sorted). An
        # entry whose prediction ended, or moved to the hold queue, is skipped when it comes up.
        self._queues: tuple[deque, deque] = (deque(), deque())
        # Routing key -> the slots predicted to hold it, encoded as the index's own holders
        # (``kv_index``): the slot when one prediction says so (nearly every key: a prompt's
        # keys chain), else the complement of the slots' bit mask, with the predictions per
        # slot behind it in ``_counts``. The index's prefix match reads it as extra holders.
        self.held: dict[int, int] = {}
        self._counts: dict[int, dict[int, int]] = {}  # key -> slot -> predictions, for keys held by several
        # Or, with held_index: the pairs there, and per slot the predictions beyond the first of a key.
        self.held_index = held_index
        self._repeats: dict[int, Counter] = {}
        self._soon_in_use: dict[int, Counter] = {}  # slot -> idle key -> unconfirmed predictions taking it
        self._sharing: dict[int, dict[int, list[Prediction]]] = {}  # slot -> key in use -> predictions sharing it

    def cached_keys(self, view: WorkerView, keys: list[int], cached: int,
                    index: KVBlockIndex) -> tuple[list[int], list[int]]:
        """The first ``cached`` keys the worker holds, split into (idle, shared): idle ones are
        not in use there and not about to be (taken by a request routed there and not yet
        started); shared ones are. A key matched only by a prediction is neither: it is being
        computed there, for the request that predicted it."""
        slot, head = view.slot, keys[:cached]
        in_use, soon = set(index.in_use_keys(slot, head)), self._soon_in_use.get(slot, ())
        idle, shared = [], []
        for k in index.held_keys(slot, head):
            (shared if k in in_use or k in soon else idle).append(k)
        return idle, shared

    def add(self, pred: Prediction, view: WorkerView) -> None:
        """Record ``pred`` on ``view`` (end the request's earlier prediction first, if any)."""
        self.by_request[pred.request_id] = pred
        self._queues[0].append((pred.expires, pred))
        view.predicted_blocks += pred.blocks
        view.predicted_seqs += pred.seqs
        view.refresh()
        if pred.idle_keys:
            self._soon_in_use.setdefault(pred.slot, Counter()).update(pred.idle_keys)
        if pred.shared_keys:
            sharing = self._sharing.setdefault(pred.slot, {})
            for key in pred.shared_keys:
                sharing.setdefault(key, []).append(pred)
        self._hold(pred.slot, pred.keys)

    def confirm(self, pred: Prediction, view: WorkerView | None) -> None:
        """The worker took the request in (or is gone: ``view`` None): from now on its own
        reports say what the request holds. The prompt keys stay until ``end``."""
        if view is not None:
            view.predicted_blocks -= pred.blocks
            view.predicted_seqs -= pred.seqs
            view.refresh()
        pred.blocks = pred.seqs = 0
        if pred.idle_keys:
            _uncount(self._soon_in_use[pred.slot], pred.idle_keys)
            pred.idle_keys = []
        if pred.shared_keys:
            sharing = self._sharing[pred.slot]
            for key in pred.shared_keys:
                sharers = sharing[key]
                sharers.remove(pred)
                if not sharers:
                    del sharing[key]
            pred.shared_keys = []

    def hold_until(self, pred: Prediction, expires: float) -> None:
        """Keep ``pred``'s prompt keys until ``expires`` (no earlier than any hold before it)."""
        pred.expires = expires
        self._queues[1].append((expires, pred))

    def expired(self, now: float) -> list[Prediction]:
        """The predictions whose time ran out by ``now`` (ending them is the caller's)."""
        out = []
        for queue in self._queues:
            while queue and queue[0][0] <= now:
                _, pred = queue.popleft()
                if self.by_request.get(pred.request_id) is pred and pred.expires <= now:
                    out.append(pred)
        return out

    def end(self, pred: Prediction, view: WorkerView | None) -> None:
        """Forget ``pred`` entirely (its time ran out, or its worker is gone: ``view`` None)."""
        self.by_request.pop(pred.request_id, None)
        self.confirm(pred, view)
        self._release(pred.slot, pred.keys)

    def holders(self, key: int) -> int:
        """Bit mask of the slots predicted to hold ``key`` (0: none)."""
        if self.held_index is not None:
            return self.held_index.holders(key)
        v = self.held.get(key)
        return 0 if v is None else holders_mask(v)

    # Routing decisions add and end a prediction each, ~100 keys apiece at a 2k-token prompt, so
    # keys held by one prediction (all but a burst's shared ones) take paths of C loops: set
    # algebra, dict.fromkeys, map over bound methods, as in the index.

    def _hold(self, slot: int, keys: list[int]) -> None:
        if self.held_index is not None:
            new = self.held_index.add_new(slot, keys)
            if len(new) != len(keys):  # some were predicted there already (or are twice in keys)
                more = Counter(keys)
                more.subtract(new)
                self._repeats.setdefault(slot, Counter()).update(+more)
            return
        held = self.held
        distinct = set(keys)
        if len(distinct) == len(keys):
            fresh = distinct.difference(held)  # predicted nowhere yet
            held.update(dict.fromkeys(fresh, slot))
            if len(fresh) == len(keys):
                return
            keys = distinct - fresh
        counts_of = self._counts
        for key in keys:
            v = held.get(key)
            if v is None:
                held[key] = slot
                continue
            counts = counts_of.get(key)
            if counts is None:  # held by one prediction until now
                counts_of[key] = counts = {v: 1}
                mask = 1 << v
            else:
                mask = ~v
            counts[slot] = counts.get(slot, 0) + 1
            held[key] = ~(mask | 1 << slot)

    def _release(self, slot: int, keys: list[int]) -> None:
        if self.held_index is not None:
            repeats = self._repeats.get(slot)
            if repeats:  # the keys another prediction (or this one, twice) holds there stay
                gone = []
                for key in keys:
                    n = repeats.get(key)
                    if not n:
                        gone.append(key)
                    elif n == 1:
                        del repeats[key]
                    else:
                        repeats[key] = n - 1
                if not repeats:
                    del self._repeats[slot]
                keys = gone
            self.held_index.remove(slot, keys)
            return
        held = self.held
        if len(set(keys)) == len(keys):
            values = list(map(held.__getitem__, keys))
            alone = list(compress(keys, map(slot.__eq__, values)))  # held by this prediction only
            deque(map(held.__delitem__, alone), maxlen=0)
            if len(alone) == len(keys):
                return
            keys = list(compress(keys, map(slot.__ne__, values)))  # held by several
        counts_of = self._counts
        for key in keys:
            v = held[key]
            if v >= 0:  # v == slot: this prediction was the only one
                del held[key]
                continue
            counts = counts_of[key]
            left = counts[slot] - 1
            if left:
                counts[slot] = left
            else:
                del counts[slot]
                v = ~(~v ^ 1 << slot)  # its bit cleared from the mask
            if len(counts) == 1:
                (only, n), = counts.items()
                if n == 1:  # one prediction left: back to the plain slot
                    held[key] = only
                    del counts_of[key]
                    continue
            held[key] = v

    def shares_on(self, slot: int) -> bool:
        """Whether a prediction on ``slot`` shares keys in use there (``stop_sharing`` has work to do)."""
        return bool(self._sharing.get(slot))

    def stop_sharing(self, view: WorkerView, index: KVBlockIndex) -> None:
        """After ``view`` changed: shared keys that nothing holds in use any more (idle with no
        request routed to take them, or gone from its cache) become blocks after all (the idle
        block itself, or a new one to compute it again), taken by the first request routed there
        to share each; the rest share it again (it is about to be in use)."""
        sharing = self._sharing.get(view.slot)
        if not sharing:
            return
        in_use, soon = set(index.in_use_keys(view.slot, sharing)), self._soon_in_use.get(view.slot, ())
        gone = [k for k in sharing if k not in in_use and k not in soon]
        if not gone:
            return
        soon = self._soon_in_use.setdefault(view.slot, Counter())
        for key in gone:
            sharers = sharing.pop(key)
            for pred in sharers:
                pred.shared_keys.remove(key)
            taker = sharers[0]
            taker.blocks += 1
            view.predicted_blocks += 1
            if index.holds(view.slot, key):  # idle there: taken, so nobody else counts it idle
                taker.idle_keys.append(key)
                soon[key] += 1
        view.refresh()


def _uncount(counter: Counter, keys: list[int]) -> list[int]:
    """Take one count of each key off ``counter`` (each key is in it); the keys that reach zero
    leave it and are returned.

    Routing decisions end predictions all the time, so distinct keys (every prediction's, in
    practice: a prompt's block hashes chain) take a path of C loops (Counter.subtract and
    Counter.__delitem__ are Python-level loops, too slow on the decision path)."""
    if len(set(keys)) != len(keys):
        counter.subtract(keys)
        gone = [key for key in dict.fromkeys(keys) if counter[key] == 0]
    else:
        left = list(map(sub, map(counter.__getitem__, keys), repeat(1)))
        dict.update(counter, zip(keys, left))
        gone = list(compress(keys, map(not_, left)))
    deque(map(dict.__delitem__, repeat(counter), gone), maxlen=0)
    return gone
