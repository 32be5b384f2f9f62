"""The global scheduler's KV index compiled: ``KVBlockIndex``'s interface over ``kv_index_native.cpp``.

The C++ source is built at first use the way the CPU engine's kernels are
(``pagefleet.kernels.cpu.build``: the machine's C++ compiler, cached across starts under a
hash of source, flags, compiler and CPU) and called through ctypes, which releases the GIL
for every call. It holds 64-bit routing keys in one open-addressing table with compact holder
records, each slot's keys in a log in the order they came, and those in use in a set; batches
arrive packed (``apply_packed``: no Python int per hash), and a run of them goes in one call
(``apply_packed_many``). ``new_kv_index`` gives it when it builds, else the pure-Python
``KVBlockIndex`` (the reference the tests hold it to) with a warning.

Slots are below ``MAX_SLOTS``. Not thread-safe, like the Python index: one caller at a time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from array import array
from itertools import chain, compress, repeat
from operator import attrgetter, lt
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Literal, Sequence

from pagefleet.kernels.cpu import build as cpu_build
from pagefleet.router.global_scheduler.kv_index import KEY_WIDTH, KVBlockIndex, pack_keys, unpack_keys
from pagefleet.worker.core.block_hash import HASH_SIZE

if TYPE_CHECKING:
    from pagefleet.worker.core.kv_events import KVEventBatch

logger = logging.getLogger(__name__)

# The index and the ranking walk over its prefix runs (ranking_native.py), one library.
SOURCES = [Path(__file__).with_name(name) for name in ("kv_index_native.cpp", "ranking_native.cpp")]
MAX_SLOTS = 1 << 16  # as the C++ source's MAX_SLOTS
KIND_ENV = "PAGEFLEET_KV_INDEX"

_P, _I, _U32, _U64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64
_BYTES = ctypes.c_char_p  # a bytes object's own buffer, not copied (packed keys are bytes)
_SLOTS = ctypes.c_uint32 * MAX_SLOTS
_PARTS = attrgetter("removed", "stored", "acquired", "released")  # a batch's packed keys, in kvi_apply_many's order
_CLEARED = attrgetter("cleared")
IDLE_COUNT = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_uint32, ctypes.c_int64)  # ranking_native's callback


def _build() -> ctypes.CDLL:
    lib = cpu_build.load_library("kv_index", "\n".join(path.read_text() for path in SOURCES))
    lib.kvi_new.restype = _P
    lib.kvi_free.argtypes = [_P]
    lib.kvi_free.restype = None
    lib.kvi_max_slots.restype = _U32
    for name in ("kvi_distinct", "kvi_entries"):
        getattr(lib, name).argtypes = [_P]
        getattr(lib, name).restype = _I
    lib.kvi_size.argtypes = [_P, _U32, ctypes.c_int]
    lib.kvi_size.restype = _I
    lib.kvi_keys.argtypes = [_P, _U32, ctypes.c_int, _P]
    lib.kvi_keys.restype = _I
    lib.kvi_among.argtypes = [_P, _U32, ctypes.c_int, _BYTES, _I, _I, _P]
    lib.kvi_among.restype = _I
    lib.kvi_holders.argtypes = [_P, _U64, _P]
    lib.kvi_holders.restype = _I
    lib.kvi_add.argtypes = [_P, _U32, _BYTES, _I, _I, _P]
    lib.kvi_add.restype = _I
    lib.kvi_remove.argtypes = [_P, _U32, _BYTES, _I, _I]
    lib.kvi_replace.argtypes = [_P, _U32, ctypes.c_int, _BYTES, _I, _I]
    lib.kvi_clear.argtypes = [_P, _U32]
    lib.kvi_apply.argtypes = [_P, _U32, ctypes.c_int, _BYTES, _I, _BYTES, _I, _BYTES, _I, _BYTES, _I, _I]
    lib.kvi_apply_many.argtypes = [_P, _I, _P, _BYTES, _P, _BYTES, _I]
    lib.kvi_prefix_runs.argtypes = [_P, _BYTES, _I, _I, _P, _P, _P, _BYTES, _I, _I, _P, _P]
    lib.kvi_prefix_runs.restype = _I
    lib.rank_best.argtypes = [_P, _P, _I, _P, _P, _I, _I, _I, _I, ctypes.c_double, _I, IDLE_COUNT, _P, _P, _P]
    lib.rank_best.restype = _I
    if lib.kvi_max_slots() != MAX_SLOTS:
        raise RuntimeError(f"kv_index_native.cpp holds {lib.kvi_max_slots()} slots, its wrapper {MAX_SLOTS}")
    return lib


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled index's library, or None (logged once) when this machine cannot build it."""
    try:
        return _build()
    except (RuntimeError, OSError) as exc:
        logger.warning("the compiled KV index did not build, so the global scheduler uses the pure-Python "
                       "index (slower ingest and decisions; docs/scaling.md): %s", str(exc).splitlines()[0])
        return None


def new_kv_index(kind: Literal["auto", "native", "python"] | None = None) -> KVBlockIndex | NativeKVBlockIndex:
    """A new index: the compiled one when it builds ("auto"), or the one named (default: ``$PAGEFLEET_KV_INDEX``,
    else "auto"; "python" runs the reference, e.g. to rule the compiled index out)."""
    kind = kind or os.environ.get(KIND_ENV) or "auto"
    if kind == "python":
        return KVBlockIndex()
    if kind not in ("auto", "native"):
        raise ValueError(f"the KV index is 'auto', 'native' or 'python', not {kind!r}")
    lib = native_library()
    if lib is None:
        if kind == "native":
            raise RuntimeError("the compiled KV index is not available on this machine (see the warning above)")
        return KVBlockIndex()
    return NativeKVBlockIndex(lib)


def _check(status: int) -> None:
    if status < 0:
        raise MemoryError("the compiled KV index ran out of memory")


def _check_width(packed: bytes, width: int) -> int:
    """How many keys ``packed`` holds."""
    if width not in (HASH_SIZE, KEY_WIDTH):
        raise ValueError(f"packed keys are {HASH_SIZE} or {KEY_WIDTH} bytes wide, not {width}")
    if len(packed) % width:
        raise ValueError(f"packed keys must be a multiple of {width} bytes, got {len(packed)}")
    return len(packed) // width


class NativeKVBlockIndex:
    """``KVBlockIndex`` in C++: routing key -> the slots holding it, plus each slot's own key set."""

    __slots__ = ("_lib", "_handle", "run_slots", "run_lengths")

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self._lib = lib or _build()  # also holds the ranking walk (ranking_native)
        self._handle = self._lib.kvi_new()
        if not self._handle:
            raise MemoryError("the compiled KV index ran out of memory")
        # prefix_run_pairs' answer: (slot, run length) pairs, read by the compiled ranking walk
        self.run_slots, self.run_lengths = _SLOTS(), _SLOTS()

    @property
    def library(self) -> ctypes.CDLL:
        return self._lib

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.kvi_free(handle)

    # ---- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Distinct keys held by anyone."""
        return self._lib.kvi_distinct(self._handle)

    def num_entries(self) -> int:
        """(slot, key) pairs."""
        return self._lib.kvi_entries(self._handle)

    def _packed(self, slot: int, in_use: bool) -> bytes:
        if not 0 <= slot < MAX_SLOTS:
            return b""
        out = ctypes.create_string_buffer(KEY_WIDTH * self._lib.kvi_size(self._handle, slot, in_use))
        n = self._lib.kvi_keys(self._handle, slot, in_use, out)
        return out.raw[:KEY_WIDTH * n]

    def _among(self, slot: int, in_use: bool, keys: Iterable[int]) -> list[int]:
        packed = pack_keys(keys)
        n = len(packed) // KEY_WIDTH
        if not n or not 0 <= slot < MAX_SLOTS:
            return []
        out = (ctypes.c_uint64 * n)()
        found = self._lib.kvi_among(self._handle, slot, in_use, packed, n, KEY_WIDTH, out)
        return out[:found]

    def packed_keys_of(self, slot: int) -> bytes:
        return self._packed(slot, False)

    def keys_of(self, slot: int) -> set[int]:
        return set(unpack_keys(self._packed(slot, False)))

    def packed_in_use_of(self, slot: int) -> bytes:
        return self._packed(slot, True)

    def in_use_of(self, slot: int) -> set[int]:
        """The keys a running sequence of ``slot`` holds."""
        return set(unpack_keys(self._packed(slot, True)))

    def holders(self, key: int) -> int:
        """Bit mask of the slots holding ``key`` (0: nobody)."""
        out = _SLOTS()
        mask = 0
        for slot in out[:self._lib.kvi_holders(self._handle, key, out)]:
            mask |= 1 << slot
        return mask

    def holds(self, slot: int, key: int) -> bool:
        return bool(self._among(slot, False, (key,)))

    def held_keys(self, slot: int, keys: Iterable[int]) -> list[int]:
        """Those of ``keys`` that ``slot`` holds, in order."""
        return self._among(slot, False, keys)

    def in_use_keys(self, slot: int, keys: Iterable[int]) -> list[int]:
        """Those of ``keys`` in use at ``slot``, in order."""
        return self._among(slot, True, keys)

    def prefix_runs(self, keys: Sequence[int], extra: dict[int, int] | None = None) -> dict[int, int]:
        """As ``KVBlockIndex.prefix_runs``: ``{run length: bit mask of the slots with that run}``."""
        runs: dict[int, int] = {}
        n = self.prefix_run_pairs(pack_keys(keys), KEY_WIDTH, keys, extra)
        for slot, run in zip(self.run_slots[:n], self.run_lengths[:n]):
            runs[run] = runs.get(run, 0) | 1 << slot
        return runs

    def prefix_run_pairs(self, packed: bytes, width: int, keys: Sequence[int],
                         extra: dict[int, int] | NativeKVBlockIndex | None = None) -> int:
        """``prefix_runs`` of the prompt ``keys`` (also given ``packed``, ``width`` bytes each) as
        (slot, run length) pairs in ``run_slots`` and ``run_lengths``; returns how many.

        ``extra``: predicted holders per key, as another compiled index (``Predictions.held_index``:
        read in C) or encoded as ``KVBlockIndex``'s (``Predictions.held``)."""
        n = _check_width(packed, width)
        if n != len(keys):
            raise ValueError(f"{n} packed keys for {len(keys)} keys")
        extra_index = extra_slot = mask_at = None
        masks, mask_words = b"", 0
        if isinstance(extra, NativeKVBlockIndex):
            extra_index = extra._handle
        elif extra:
            # A slot per key (-1: none) is one C-speed pass; keys predicted on several slots (a
            # mask's complement, v < -1: a burst's shared prefix) go as bitsets.
            values = list(map(extra.get, keys, repeat(-1)))
            if min(values, default=-1) < -1:
                at = list(compress(range(n), map(lt, values, repeat(-1))))
                bits = [~values[i] for i in at]
                mask_words = (max(bits).bit_length() + 63) // 64
                if mask_words * 64 > MAX_SLOTS:
                    raise ValueError(f"slots must be below {MAX_SLOTS}")
                masks = b"".join(mask.to_bytes(8 * mask_words, sys.byteorder) for mask in bits)
                mask_at = array("q", at)
                for i in at:
                    values[i] = -1
            if max(values, default=-1) >= MAX_SLOTS:
                raise ValueError(f"slots must be below {MAX_SLOTS}")
            if max(values, default=-1) >= 0:
                extra_slot = array("q", values)
        found = self._lib.kvi_prefix_runs(self._handle, packed, n, width, extra_index,
                                          extra_slot and extra_slot.buffer_info()[0],
                                          mask_at and mask_at.buffer_info()[0], masks, len(mask_at or ()),
                                          mask_words, self.run_slots, self.run_lengths)
        _check(found)
        return found

    # ---- updates ---------------------------------------------------------------------------

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slots must be in [0, {MAX_SLOTS}), got {slot}")
        return slot

    def add(self, slot: int, keys: Iterable[int]) -> None:
        packed = pack_keys(keys)
        _check(self._lib.kvi_add(self._handle, self._slot(slot), packed, len(packed) // KEY_WIDTH, KEY_WIDTH, None))

    def add_new(self, slot: int, keys: Iterable[int]) -> list[int]:
        """``add``, returning those of ``keys`` that ``slot`` did not hold yet (each once, in order)."""
        packed = pack_keys(keys)
        n = len(packed) // KEY_WIDTH
        out = (ctypes.c_uint64 * n)()
        added = self._lib.kvi_add(self._handle, self._slot(slot), packed, n, KEY_WIDTH, out)
        _check(added)
        return out[:added]

    def remove(self, slot: int, keys: Iterable[int]) -> None:
        packed = pack_keys(keys)
        _check(self._lib.kvi_remove(self._handle, self._slot(slot), packed, len(packed) // KEY_WIDTH, KEY_WIDTH))

    def clear(self, slot: int) -> None:
        """Forget everything ``slot`` holds."""
        _check(self._lib.kvi_clear(self._handle, self._slot(slot)))

    def replace(self, slot: int, keys: Iterable[int]) -> None:
        """Make ``slot`` hold exactly ``keys`` (a snapshot), touching only the difference."""
        self.replace_packed(slot, pack_keys(keys), width=KEY_WIDTH)

    def apply_packed(self, slot: int, removed: bytes, stored: bytes, *, cleared: bool = False,
                     acquired: bytes = b"", released: bytes = b"", width: int = HASH_SIZE) -> None:
        """One KV event batch of ``slot``, as ``KVBlockIndex.apply_packed``: one call, no Python int per hash."""
        r, s, a, u = len(removed), len(stored), len(acquired), len(released)
        if width not in (HASH_SIZE, KEY_WIDTH) or (r | s | a | u) % width:  # (widths are powers of two)
            raise ValueError(f"packed keys are {HASH_SIZE} or {KEY_WIDTH} bytes each, got {width} for "
                             f"{(r, s, a, u)} bytes")
        _check(self._lib.kvi_apply(self._handle, self._slot(slot), cleared, removed, r // width, stored, s // width,
                                   acquired, a // width, released, u // width, width))

    def apply_packed_many(self, slots: Sequence[int], batches: Sequence[KVEventBatch], *,
                          width: int = HASH_SIZE) -> None:
        """``apply_packed`` of each batch (``cleared``, ``removed``, ``stored``, ``acquired``, ``released``)
        on its slot, in order, in one call: the Python per batch is C loops (a join of their keys, their
        lengths). A malformed batch raises ValueError before any is applied."""
        if len(slots) != len(batches):
            raise ValueError(f"{len(slots)} slots for {len(batches)} batches")
        if width not in (HASH_SIZE, KEY_WIDTH):
            raise ValueError(f"packed keys are {HASH_SIZE} or {KEY_WIDTH} bytes wide, not {width}")
        if not batches:
            return
        parts = list(chain.from_iterable(map(_PARTS, batches)))
        lengths = array("q", map(len, parts))
        cleared = bytes(map(_CLEARED, batches))
        try:
            slot_of = array("I", slots)
        except OverflowError:
            slot_of = None
        status = -2 if slot_of is None else self._lib.kvi_apply_many(
            self._handle, len(batches), slot_of.buffer_info()[0], cleared, lengths.buffer_info()[0], b"".join(parts),
            width)
        if status == -2:
            raise ValueError(f"slots must be in [0, {MAX_SLOTS}) and packed keys {width} bytes each, got slots "
                             f"{min(slots)}..{max(slots)} and lengths {sorted(set(lengths))}")
        _check(status)

    def replace_packed(self, slot: int, packed: bytes, *, width: int = HASH_SIZE) -> None:
        """Make ``slot`` cache exactly these keys (a snapshot's; what is in use is left alone)."""
        _check(self._lib.kvi_replace(self._handle, self._slot(slot), False, packed, _check_width(packed, width),
                                     width))

    def replace_in_use_packed(self, slot: int, packed: bytes, *, width: int = HASH_SIZE) -> None:
        """Make exactly these keys in use at ``slot``."""
        _check(self._lib.kvi_replace(self._handle, self._slot(slot), True, packed, _check_width(packed, width),
                                     width))
