"""Which workers hold which KV blocks: the global scheduler's index, no Ray, no torch.

Workers are small integer *slots*. Blocks are *routing keys*: the first 8
bytes of their block hash as an unsigned int (a 64-bit key only decides where
a request goes, so a collision costs a worse route, never a wrong answer; the
workers themselves compare full 16-byte hashes).

Memory is the constraint at scale (hundreds of workers x 100k blocks), so
the key -> holders map stores one small int per key: a key held by a single
worker maps to that worker's slot (``v >= 0``; slots below 257 are ints
Python never allocates), a key held by several maps to the bitwise complement
of their bit mask (``v < 0``). Each slot also keeps the set of its keys, so a
worker can be dropped or resynchronised in time proportional to what it holds,
and the set of those a running sequence holds (*in use*: reusing an idle cached
block takes room, sharing one in use does not), which its KV event batches keep
current with the rest.

This is the reference; ``kv_index_native`` holds the same in C++.
"""

from __future__ import annotations

import sys
from array import array
from collections import deque
from itertools import compress
from typing import TYPE_CHECKING, Iterable, Sequence

from pagefleet.worker.core.block_hash import HASH_SIZE

if TYPE_CHECKING:
    from pagefleet.worker.core.kv_events import KVEventBatch

KEY_WIDTH = 8  # bytes per routing key, packed


def routing_keys(packed_hashes: bytes) -> list[int]:
    """The routing key of each packed block hash (``HASH_SIZE`` bytes each), in order."""
    if len(packed_hashes) % HASH_SIZE:
        raise ValueError(f"packed hashes must be a multiple of {HASH_SIZE} bytes, got {len(packed_hashes)}")
    words = memoryview(packed_hashes).cast("Q")  # native order; two 8-byte words per hash
    keys = words[::HASH_SIZE // 8].tolist()
    if sys.byteorder == "big":  # keys must agree across machines: they are little-endian by definition
        keys = [int.from_bytes(k.to_bytes(8, "big"), "little") for k in keys]
    return keys


def unpack_routing_keys(packed: bytes, width: int) -> list[int]:
    """The routing keys of packed block hashes (``width`` HASH_SIZE) or packed keys (KEY_WIDTH)."""
    if width == HASH_SIZE:
        return routing_keys(packed)
    if width == KEY_WIDTH:
        return unpack_keys(packed)
    raise ValueError(f"packed keys are {HASH_SIZE} or {KEY_WIDTH} bytes wide, not {width}")


def pack_keys(keys: Iterable[int]) -> bytes:
    """Routing keys as 8 little-endian bytes each (one bytes object: pickles at C speed)."""
    packed = array("Q", keys)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_keys(packed: bytes) -> list[int]:
    keys = array("Q")
    keys.frombytes(packed)
    if sys.byteorder == "big":
        keys.byteswap()
    return keys.tolist()


def holders_mask(v: int) -> int:
    """The bit mask of slots a holders value stands for (a slot, or a mask's complement)."""
    return 1 << v if v >= 0 else ~v


class KVBlockIndex:
    """Routing key -> the slots holding it, plus each slot's own key set and those of it in use."""

    __slots__ = ("_holders", "_keys", "_in_use")

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._keys: list[set[int]] = []
        self._in_use: list[set[int]] = []  # per slot; not necessarily cached (its batches say so)

    # ---- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Distinct keys held by anyone."""
        return len(self._holders)

    def num_entries(self) -> int:
        """(slot, key) pairs: what a per-worker view would hold in total."""
        return sum(len(keys) for keys in self._keys)

    def keys_of(self, slot: int) -> set[int]:
        return set(self._keys[slot]) if slot < len(self._keys) else set()

    def holders(self, key: int) -> int:
        """Bit mask of the slots holding ``key`` (0: nobody)."""
        v = self._holders.get(key)
        return 0 if v is None else holders_mask(v)

    def holds(self, slot: int, key: int) -> bool:
        v = self._holders.get(key)
        return v is not None and (v == slot if v >= 0 else bool(~v >> slot & 1))

    def held_keys(self, slot: int, keys: Iterable[int]) -> list[int]:
        """Those of ``keys`` that ``slot`` holds, in order."""
        mine = self._keys[slot] if slot < len(self._keys) else ()
        return [key for key in keys if key in mine]

    def packed_keys_of(self, slot: int) -> bytes:
        """``keys_of(slot)`` packed (``pack_keys``)."""
        return pack_keys(self._keys[slot]) if slot < len(self._keys) else b""

    def in_use_of(self, slot: int) -> set[int]:
        """The keys a running sequence of ``slot`` holds."""
        return set(self._in_use[slot]) if slot < len(self._in_use) else set()

    def packed_in_use_of(self, slot: int) -> bytes:
        return pack_keys(self._in_use[slot]) if slot < len(self._in_use) else b""

    def in_use_keys(self, slot: int, keys: Iterable[int]) -> list[int]:
        """Those of ``keys`` in use at ``slot``, in order."""
        mine = self._in_use[slot] if slot < len(self._in_use) else ()
        return [key for key in keys if key in mine]

    def prefix_runs(self, keys: Sequence[int], extra: dict[int, int] | None = None) -> dict[int, int]:
        """How many leading ``keys`` each slot holds without a gap, as ``{run length: bit mask of
        the slots with that run}`` (runs of 0 are left out).

        ``extra`` adds holders per key, encoded as this index's own (a slot, or the complement
        of a bit mask): blocks predicted but not yet confirmed (``Predictions.held``)."""
        get = self._holders.get
        xget = extra.get if extra else None
        runs: dict[int, int] = {}
        current = 0
        for i, key in enumerate(keys):
            v = get(key)
            m = 0 if v is None else (1 << v if v >= 0 else ~v)
            if xget is not None:
                x = xget(key)
                if x is not None:
                    m |= 1 << x if x >= 0 else ~x
            if i:
                following = current & m
                if following != current:  # the runs of these slots end here
                    runs[i] = current ^ following
                current = following
            else:
                current = m
            if not current:
                return runs
        if current:  # (no keys: no runs)
            runs[len(keys)] = current
        return runs

    # ---- updates ---------------------------------------------------------------------------

    def _slot_keys(self, slot: int) -> set[int]:
        while len(self._keys) <= slot:
            self._keys.append(set())
            self._in_use.append(set())
        return self._keys[slot]

    # add and remove do their per-key work in C (set algebra, dict.fromkeys, map over bound
    # methods); only keys held by several workers take a Python-level step. That is what
    # lets one core keep up with a fleet's event stream (benchmarks/scheduler_scale.py).

    def add(self, slot: int, keys: Iterable[int]) -> None:
        mine = self._slot_keys(slot)
        new = set(keys)
        new -= mine
        if not new:
            return
        mine |= new
        holders = self._holders
        fresh = new.difference(holders)  # held by nobody yet: the common case
        if fresh:
            holders.update(dict.fromkeys(fresh, slot))
            if len(fresh) == len(new):
                return
            new -= fresh
        bit = 1 << slot
        for key in new:
            v = holders[key]
            holders[key] = ~(1 << v | bit) if v >= 0 else v & ~bit  # v & ~bit == ~(~v | bit)

    def add_new(self, slot: int, keys: Iterable[int]) -> list[int]:
        """``add``, returning those of ``keys`` that ``slot`` did not hold yet (each once, in order)."""
        mine = self._slot_keys(slot)
        new = [key for key in dict.fromkeys(keys) if key not in mine]
        self.add(slot, new)
        return new

    def remove(self, slot: int, keys: Iterable[int]) -> None:
        mine = self._slot_keys(slot)
        gone = mine.intersection(keys)  # keys this slot does not hold are no-ops
        if not gone:
            return
        mine -= gone
        holders = self._holders
        values = list(map(holders.__getitem__, gone))
        alone = list(compress(gone, map(slot.__eq__, values)))
        deque(map(holders.__delitem__, alone), maxlen=0)  # a C loop deleting every key
        if len(alone) == len(values):
            return
        bit = 1 << slot
        for key, v in zip(gone, values):
            if v < 0:
                rest = ~v ^ bit
                holders[key] = rest.bit_length() - 1 if rest & (rest - 1) == 0 else ~rest

    def clear(self, slot: int) -> None:
        """Forget everything ``slot`` holds, in use or not."""
        if slot < len(self._keys):
            self.remove(slot, self._keys[slot].copy())
            self._in_use[slot].clear()

    def replace(self, slot: int, keys: Iterable[int]) -> None:
        """Make ``slot`` hold exactly ``keys`` (a snapshot), touching only the difference."""
        new = set(keys)
        old = self._slot_keys(slot)
        self.remove(slot, old - new)
        self.add(slot, new - old)

    # The same updates with keys packed as they arrive: ``width`` bytes per key, the routing key
    # its first 8 (HASH_SIZE: block hashes of KV events and snapshots; KEY_WIDTH: ``pack_keys``).

    def apply_packed(self, slot: int, removed: bytes, stored: bytes, *, cleared: bool = False,
                     acquired: bytes = b"", released: bytes = b"", width: int = HASH_SIZE) -> None:
        """One KV event batch of ``slot``, in its order: ``cleared`` (nothing cached or in use),
        ``removed`` (left the cache), ``stored`` (cached, in use), ``acquired`` (cached blocks
        that went from idle to in use), ``released`` (from in use to idle)."""
        self._slot_keys(slot)
        in_use = self._in_use[slot]
        if cleared:
            self.clear(slot)
        if removed:
            keys = unpack_routing_keys(removed, width)
            self.remove(slot, keys)
            in_use.difference_update(keys)
        if stored:
            keys = unpack_routing_keys(stored, width)
            self.add(slot, keys)
            in_use.update(keys)
        if acquired:
            in_use.update(unpack_routing_keys(acquired, width))
        if released:
            in_use.difference_update(unpack_routing_keys(released, width))

    def apply_packed_many(self, slots: Sequence[int], batches: Sequence[KVEventBatch], *,
                          width: int = HASH_SIZE) -> None:
        """``apply_packed`` of each batch (``cleared``, ``removed``, ``stored``, ``acquired``,
        ``released``) on its slot, in order. A malformed batch raises ValueError before any is applied."""
        if len(slots) != len(batches):
            raise ValueError(f"{len(slots)} slots for {len(batches)} batches")
        if width not in (HASH_SIZE, KEY_WIDTH):
            raise ValueError(f"packed keys are {HASH_SIZE} or {KEY_WIDTH} bytes wide, not {width}")
        for slot, b in zip(slots, batches):
            if slot < 0 or any(len(part) % width for part in (b.removed, b.stored, b.acquired, b.released)):
                raise ValueError(f"slots must be >= 0 and packed keys {width} bytes each, got slot {slot} and "
                                 f"lengths {[len(part) for part in (b.removed, b.stored, b.acquired, b.released)]}")
        for slot, b in zip(slots, batches):
            self.apply_packed(slot, b.removed, b.stored, cleared=b.cleared, acquired=b.acquired,
                              released=b.released, width=width)

    def replace_packed(self, slot: int, packed: bytes, *, width: int = HASH_SIZE) -> None:
        """Make ``slot`` cache exactly these keys (a snapshot's; what is in use is left alone)."""
        self.replace(slot, unpack_routing_keys(packed, width))

    def replace_in_use_packed(self, slot: int, packed: bytes, *, width: int = HASH_SIZE) -> None:
        """Make exactly these keys in use at ``slot``."""
        self._slot_keys(slot)
        self._in_use[slot] = set(unpack_routing_keys(packed, width))
