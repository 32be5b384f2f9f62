"""The compiled KV index against the pure-Python reference: the same random event streams, every query equal."""

from __future__ import annotations

import logging
import random

import pytest

from pagefleet.router.global_scheduler import kv_index_native
from pagefleet.router.global_scheduler.kv_index import KEY_WIDTH, KVBlockIndex, pack_keys, unpack_keys
from pagefleet.router.global_scheduler.kv_index_native import NativeKVBlockIndex, new_kv_index
from pagefleet.worker.core.kv_events import KVEventBatch

# Slots past 64 and 256 (bit masks of several words); 299 is never written (an unknown slot).
SLOTS = (0, 1, 2, 5, 63, 64, 65, 130, 255, 256, 298)
UNKNOWN_SLOT = 299


@pytest.fixture
def lib(compiled_lib):
    return compiled_lib


def hash_of(key: int, rng: random.Random) -> bytes:
    """A 16-byte block hash whose routing key is ``key`` (the rest is noise the index must ignore)."""
    return key.to_bytes(8, "little") + rng.randbytes(8)


class Streams:
    """Random KV events for both indexes at once, with each worker's truth beside them.

    Keys come from a small pool (so many slots share keys: holders move between one slot, a few
    and a bitset, and back), from the edges of the 64-bit range, and fresh at random."""

    def __init__(self, seed: int, lib, long_runs: bool = False) -> None:
        self.rng = random.Random(seed)
        self.long_runs = long_runs  # most steps are batches: long runs of them go in one call
        self.longest_run = 0
        self.py, self.native = KVBlockIndex(), NativeKVBlockIndex(lib)
        self.truth: dict[int, set[int]] = {slot: set() for slot in SLOTS}
        self.pool = [0, 1, 2**64 - 1, 2**63] + [self.rng.getrandbits(64) for _ in range(60)]
        self.seen: list[int] = list(self.pool)  # every key used so far
        self.behind: set[int] = set()  # slots whose batch was lost: the indexes lag their truth until a snapshot
        # Batches held back to go into the compiled index in one call (the reference takes them one by one)
        self.queued: list[tuple[int, KVEventBatch]] = []

    def flush(self) -> None:
        self.longest_run = max(self.longest_run, len(self.queued))
        if self.queued:
            slots, batches = zip(*self.queued)
            self.native.apply_packed_many(slots, batches)
            for slot, b in self.queued:
                self.py.apply_packed(slot, b.removed, b.stored, cleared=b.cleared, acquired=b.acquired,
                                     released=b.released)
            self.queued.clear()

    def key(self) -> int:
        rng = self.rng
        if rng.random() < 0.7:
            return rng.choice(self.pool)
        key = rng.getrandbits(64)
        self.seen.append(key)
        return key

    def both(self, method: str, *args, **kwargs) -> None:
        getattr(self.py, method)(*args, **kwargs)
        getattr(self.native, method)(*args, **kwargs)

    def step(self) -> None:
        rng = self.rng
        slot = rng.choice(SLOTS)
        mine = self.truth[slot]
        op = rng.random()
        if self.long_runs and op >= 0.45 and rng.random() < 0.8:
            op *= 0.45
        if op >= 0.45:  # what is queued goes in before anything else
            self.flush()
        if op < 0.45:  # a batch: removes (some not held), stores (some held already, some twice), a clear,
            # cached keys going in and out of use (and keys not cached: the index takes the batch's word)
            removed = rng.sample(sorted(mine), min(len(mine), rng.randrange(0, 8))) + [self.key()]
            stored = [self.key() for _ in range(rng.randrange(0, 10))]
            stored += stored[:1]
            acquired = rng.sample(sorted(mine), min(len(mine), rng.randrange(0, 4)))
            acquired += [self.key()] * (rng.random() < 0.2)
            held = sorted(mine | set(stored))
            released = rng.sample(held, min(len(held), rng.randrange(0, 5)))
            cleared = rng.random() < 0.03
            if cleared:
                mine.clear()
            mine.difference_update(removed)
            mine.update(stored)
            if rng.random() < 0.05:
                self.behind.add(slot)
                return  # lost on the way (a gap): the indexes miss it until the next snapshot
            removed, stored, acquired, released = (b"".join(hash_of(k, rng) for k in keys)
                                                   for keys in (removed, stored, acquired, released))
            if rng.random() < (0.95 if self.long_runs else 0.6):  # in one call with the batches around it
                self.queued.append((slot, KVEventBatch("", 0, 0, cleared, stored, removed=removed, acquired=acquired,
                                                       released=released)))
                return
            self.flush()
            self.both("apply_packed", slot, removed, stored, cleared=cleared, acquired=acquired, released=released)
        elif op < 0.6:
            keys = [self.key() for _ in range(rng.randrange(0, 6))]
            keys += keys[:1]
            mine.update(keys)
            if rng.random() < 0.5:
                self.both("add", slot, keys)
            else:
                assert self.native.add_new(slot, keys) == self.py.add_new(slot, keys)
        elif op < 0.7:
            keys = rng.sample(sorted(mine), min(len(mine), rng.randrange(0, 6))) + [self.key()]
            mine.difference_update(keys)
            self.both("remove", slot, keys)
        elif op < 0.8:  # a snapshot: the worker's truth, as hashes, packed keys or ints
            keep = set(rng.sample(sorted(mine), len(mine) // 2)) | {self.key() for _ in range(rng.randrange(0, 5))}
            mine.clear()
            mine.update(keep)
            self.behind.discard(slot)
            keys = sorted(keep) * rng.choice([1, 2])
            rng.shuffle(keys)
            form = rng.randrange(3)
            if form == 0:
                self.both("replace_packed", slot, b"".join(hash_of(k, rng) for k in keys))
            elif form == 1:
                self.both("replace_packed", slot, pack_keys(keys), width=KEY_WIDTH)
            else:
                self.both("replace", slot, keys)
            in_use = rng.sample(sorted(keep), len(keep) // 3)
            if rng.random() < 0.5:
                self.both("replace_in_use_packed", slot, b"".join(hash_of(k, rng) for k in in_use))
            else:
                self.both("replace_in_use_packed", slot, pack_keys(in_use), width=KEY_WIDTH)
        elif op < 0.85:  # a drop
            mine.clear()
            self.behind.discard(slot)
            self.both("clear", slot)
        elif op < 0.9:  # a worker's whole cache at once, then most of it gone: the tables grow and shrink
            keys = [rng.getrandbits(64) for _ in range(rng.randrange(500, 3000))]
            self.seen += keys
            mine.update(keys)
            self.both("add", slot, keys)
            gone = keys[: len(keys) * 9 // 10]
            mine.difference_update(gone)
            self.both("apply_packed", slot, pack_keys(gone), b"", width=KEY_WIDTH)
        else:  # one key on most slots (a popular prompt), then off them again
            key = rng.choice(self.pool)
            on = rng.sample(SLOTS, rng.randrange(1, len(SLOTS) + 1))
            for s in on:
                self.truth[s].add(key)
                self.both("add", s, [key])
            for s in on[: rng.randrange(len(on) + 1)]:
                self.truth[s].discard(key)
                self.both("remove", s, [key])

    def prompts(self) -> list[list[int]]:
        """Prompts that follow what some slot holds, then leave it; one of nobody's keys; none."""
        rng = self.rng
        out = [[], [rng.getrandbits(64)]]
        for slot in rng.sample(SLOTS, 4):
            held = sorted(self.truth[slot])
            rng.shuffle(held)
            head = held[: rng.randrange(len(held) + 1)]
            out.append(head + [rng.choice(self.pool) for _ in range(rng.randrange(0, 4))] + head[:1])
        out.append(list(self.pool[:12]))
        return out

    def extra(self, keys: list[int]) -> dict[int, int]:
        """Predicted holders as ``Predictions.held`` encodes them: a slot, or a mask's complement."""
        rng, extra = self.rng, {}
        for key in rng.sample(keys, len(keys) // 2):
            if rng.random() < 0.7:
                extra[key] = rng.choice(SLOTS + (UNKNOWN_SLOT, 400))
            else:
                extra[key] = ~sum(1 << s for s in rng.sample(SLOTS + (400,), rng.randrange(2, 5)))
        extra[rng.getrandbits(64)] = 3  # a key no prompt has
        return extra


def index_of(extra: dict[int, int], lib) -> NativeKVBlockIndex:
    """Predicted holders (``Predictions.held``'s encoding) as a compiled index, as Predictions keeps them beside one."""
    index = NativeKVBlockIndex(lib)
    for key, v in extra.items():
        mask = 1 << v if v >= 0 else ~v
        while mask:
            low = mask & -mask
            index.add(low.bit_length() - 1, [key])
            mask ^= low
    return index


def assert_same(s: Streams) -> None:
    s.flush()
    py, native, rng = s.py, s.native, s.rng
    assert (len(native), native.num_entries()) == (len(py), py.num_entries())
    for slot in SLOTS + (UNKNOWN_SLOT,):
        assert native.keys_of(slot) == py.keys_of(slot)
        if slot not in s.behind:
            assert py.keys_of(slot) == s.truth.get(slot, set())
        assert sorted(unpack_keys(native.packed_keys_of(slot))) == sorted(unpack_keys(py.packed_keys_of(slot)))
        probe = rng.sample(s.seen, 40)
        probe += probe[:3]
        assert native.held_keys(slot, probe) == py.held_keys(slot, probe)
        assert native.in_use_of(slot) == py.in_use_of(slot)
        assert sorted(unpack_keys(native.packed_in_use_of(slot))) == sorted(unpack_keys(py.packed_in_use_of(slot)))
        in_use = sorted(py.in_use_of(slot))
        probe += in_use[:5] + in_use[:1]
        assert native.in_use_keys(slot, probe) == py.in_use_keys(slot, probe)
        assert [native.holds(slot, k) for k in probe] == [py.holds(slot, k) for k in probe]
    for key in s.pool + rng.sample(s.seen, 100):
        assert native.holders(key) == py.holders(key)
    for keys in s.prompts():
        assert native.prefix_runs(keys) == py.prefix_runs(keys)
        extra = s.extra(keys)
        expected = py.prefix_runs(keys, extra)
        assert native.prefix_runs(keys, extra) == expected
        assert native.prefix_runs(keys, index_of(extra, s.native.library)) == expected  # Predictions.held_index


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_index_answers_every_query_as_the_reference_on_random_streams(seed, lib):
    s = Streams(seed, lib, long_runs=seed % 2 == 1)
    for i in range(1500):
        s.step()
        if i % 50 == 49:
            assert_same(s)
    assert_same(s)
    assert s.py.num_entries() > 0 and len(s.py) > 0
    assert s.longest_run >= (10 if s.long_runs else 2)


def test_a_malformed_batch_in_a_run_applies_none_of_it(lib):
    def keys(*ks):
        return b"".join(k.to_bytes(8, "little") + bytes(8) for k in ks)

    for index in (KVBlockIndex(), NativeKVBlockIndex(lib)):
        good = KVEventBatch("w", 0, 0, False, keys(1, 2))
        for slots, batches in (([1, 2], [good, KVEventBatch("w", 0, 0, False, bytes(15))]),
                               ([1, 2], [good, KVEventBatch("w", 0, 0, False, released=bytes(24))]),
                               ([1], [good, good]), ([1, -1], [good, good])):
            with pytest.raises(ValueError):
                index.apply_packed_many(slots, batches)
            assert index.num_entries() == 0
        # in order, each on its slot: stored, one of them removed again, stored and acquired elsewhere
        index.apply_packed_many([7, 7, 3], [good, KVEventBatch("w", 0, 0, False, removed=keys(1)),
                                            KVEventBatch("w", 0, 0, False, keys(2), acquired=keys(9))])
        assert (index.keys_of(7), index.in_use_of(7), index.keys_of(3), index.in_use_of(3)) == ({2}, {2}, {2}, {2, 9})
        index.apply_packed_many([7], [KVEventBatch("w", 0, 0, True, keys(5))])
        assert (index.keys_of(7), index.in_use_of(7), index.holders(2)) == ({5}, {5}, 1 << 3)
    with pytest.raises(ValueError):
        NativeKVBlockIndex(lib).apply_packed_many([kv_index_native.MAX_SLOTS], [good])


def test_a_workers_keys_leaving_in_any_order_and_coming_back_stay_exact(lib):
    """Evictions oldest first (as pools evict), a request's blocks last first, out of order, and keys
    that leave and come back, on two slots sharing keys: every slot's keys (each once), holders and
    entries stay exact."""
    rng = random.Random(7)
    native, py = NativeKVBlockIndex(lib), KVBlockIndex()
    held: dict[int, dict[int, None]] = {3: {}, 4: {}}  # per slot, its keys in the order they came
    for step in range(4000):
        slot = 3 if rng.random() < 0.8 else 4
        mine, op = held[slot], rng.random()
        if op < 0.4:
            keys = [rng.randrange(600) for _ in range(rng.randrange(1, 30))]
            for key in keys:
                mine.setdefault(key)
        elif op < 0.7:
            keys = list(mine)[: rng.randrange(40)]  # the oldest, in order or last first (a request's blocks)
            if op < 0.55:
                keys.reverse()
            for key in keys:
                del mine[key]
        elif op < 0.97:
            keys = rng.sample(list(mine), min(len(mine), rng.randrange(10))) + [rng.randrange(600)]
            for key in keys:
                mine.pop(key, None)
        else:
            keys = rng.sample(list(mine), len(mine) // 2) + [rng.randrange(600)]
            held[slot] = dict.fromkeys(keys)
            native.replace(slot, keys)
            py.replace(slot, keys)
            continue
        for index in (native, py):
            (index.add if op < 0.4 else index.remove)(slot, keys)
        if step % 97 == 0 or step == 3999:
            for s_, keys_held in held.items():
                packed = unpack_keys(native.packed_keys_of(s_))
                assert sorted(packed) == sorted(keys_held) and native.keys_of(s_) == py.keys_of(s_)
                assert native.held_keys(s_, range(600)) == py.held_keys(s_, range(600))
            assert native.num_entries() == sum(map(len, held.values())) == py.num_entries()
            assert [native.holders(k) for k in range(600)] == [py.holders(k) for k in range(600)]
    native.clear(3)
    assert native.keys_of(3) == set() and native.num_entries() == len(held[4])


def test_several_holders_go_from_a_slot_to_a_list_to_a_bitset_and_back(lib):
    """Exact holders across the encodings (one slot; up to three; a bitset over slots past 64)."""
    index = NativeKVBlockIndex(lib)
    on = [3, 70, 300, 1, 129]
    for i, slot in enumerate(on):
        index.add(slot, [7])
        assert index.holders(7) == sum(1 << s for s in on[: i + 1])
    assert index.prefix_runs([7, 8]) == {1: sum(1 << s for s in on)}
    for i, slot in enumerate(on):
        index.remove(slot, [7])
        assert index.holders(7) == sum(1 << s for s in on[i + 1:])
    assert len(index) == 0 and index.num_entries() == 0 and index.prefix_runs([7]) == {}


def test_packed_hashes_are_read_by_their_first_8_bytes_little_endian(lib):
    index = NativeKVBlockIndex(lib)
    index.apply_packed(2, b"", bytes(range(16)) + bytes(range(16, 32)))
    assert index.keys_of(2) == {int.from_bytes(bytes(range(8)), "little"),
                                int.from_bytes(bytes(range(16, 24)), "little")}
    with pytest.raises(ValueError):
        index.apply_packed(2, b"", bytes(15))
    with pytest.raises(ValueError):
        index.replace_packed(2, bytes(16), width=12)
    with pytest.raises(ValueError):
        index.add(kv_index_native.MAX_SLOTS, [1])
    assert index.keys_of(kv_index_native.MAX_SLOTS) == set() and not index.holds(-1, 1)


def test_without_a_compiler_the_scheduler_falls_back_to_the_reference_with_a_warning(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("the CPU engine's compiled kernels need a C++ compiler ('c++': not found)")

    monkeypatch.setattr(kv_index_native, "_build", no_compiler)
    monkeypatch.delenv(kv_index_native.KIND_ENV, raising=False)
    kv_index_native.native_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=kv_index_native.__name__):
            assert type(new_kv_index()) is KVBlockIndex
            assert type(new_kv_index()) is KVBlockIndex
        assert [r.getMessage().split(":")[0] for r in caplog.records] == [
            "the compiled KV index did not build, so the global scheduler uses the pure-Python index (slower ingest "
            "and decisions; docs/scaling.md)"]  # once, not per index
        with pytest.raises(RuntimeError):
            new_kv_index("native")
    finally:
        kv_index_native.native_library.cache_clear()
    assert type(new_kv_index("python")) is KVBlockIndex
