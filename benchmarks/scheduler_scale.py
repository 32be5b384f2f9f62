"""The global scheduler's core alone at fleet scale: 256 simulated workers x 100k KV blocks each.

No Ray, no model: the core (``pagefleet.router.global_scheduler.core``) is fed the
plain dataclasses a fleet of workers would publish, on one core, and timed.

Workload (seeded):
  * each worker's pool is full: 100,000 cached block hashes, in LRU order, as
    chunks: shared system prompts (512 tokens = 32 blocks, from a pool of 4,000,
    Zipf-popular, so the popular ones sit on most workers; 20% of each pool)
    and unique request blocks (80%);
  * fill: one snapshot per worker (what a restarted scheduler rebuilds from);
  * churn: step batches in random worker order, 70% decode-like (4-16 new
    blocks) and 30% prefill-like (32-128 new blocks, half of them starting with
    a shared system prompt the worker may already hold, which then stores only
    its tail); each batch evicts the worker's oldest chunks until the new blocks fit
    (a chunk's blocks in the order they were stored, or with --evict-order
    tail-first last first, as the engine frees a finished request's blocks);
    a prefix it already held is acquired (idle to in use), and the worker's
    running requests (its last 16 chunks stored or acquired) end in order: what
    drops out of them is released (in use to idle);
  * decisions: 2k-token prompts (128 blocks): 40% a popular system prompt plus
    a new question, 30% a conversation continuing on one worker (96 blocks it
    holds, 32 new), 30% nothing cached anywhere; each decision is recorded as a
    prediction (2 s ttl), and batches keep arriving between decisions.

Results, one JSON line each: block events ingested per second along the two paths
batches take (an ingress's copy of the view applies a feed update of many batches at
once, ``update_*``; the actor applies each publish call's batch, ``core_*``), each
for the core alone and with unpickling what arrives (``*with_unpickle*``), rebuild-from-snapshots
time, decision latency p50/p99/max, bytes per tracked (worker, block) entry
(resident memory of the scheduler's state divided by the entries), and the machine.
Times are wall clock and, beside them, this thread's CPU time: on a shared
machine the wall clock also counts the time other processes held the core.

    python benchmarks/scheduler_scale.py                  # the full 256 x 100k, compiled index
    python benchmarks/scheduler_scale.py --workers 1000   # 1,000 x 100k: 100M entries (~7 GB peak)
    python benchmarks/scheduler_scale.py --index python   # the pure-Python reference index
    python benchmarks/scheduler_scale.py --workers 8 --blocks 5000 --batches 2000 --decisions 500   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import random
import resource
import time
from collections import deque
from itertools import accumulate

from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.kv_mirror import SchedulerMirror
from pagefleet.router.global_scheduler.view_feed import ViewUpdate, slim
from pagefleet.router.global_scheduler.views import RouteRequest
from pagefleet.worker.core.block_hash import HASH_SIZE, ROOT_HASH
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot, pack_token_ids

from _machine import machine_with_load as machine

BLOCK_SIZE = 16
PREFIX_BLOCKS = 32  # a 512-token system prompt
NUM_PREFIXES = 4000
SHARED_FRACTION = 0.2
PROMPT_BLOCKS = 128  # 2k tokens
RUNNING_CHUNKS = 16  # chunks a worker's running requests hold in use
INGEST_TURNS = 4  # times each ingest path takes its turn over the stream


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Fleet:
    """Each simulated worker's cache as a FIFO of chunks (oldest first): (packed hashes, prefix id or None)."""

    def __init__(self, num_workers: int, num_blocks: int, rng: random.Random, tail_first: bool = False) -> None:
        self.rng = rng
        self.tail_first = tail_first  # a chunk's blocks leave last block first (the engine frees them so)
        self.num_blocks = num_blocks
        self.prefixes = [os.urandom(PREFIX_BLOCKS * HASH_SIZE) for _ in range(NUM_PREFIXES)]
        self.cum_weights = list(accumulate(1.0 / (i + 1) ** 1.1 for i in range(NUM_PREFIXES)))
        self.caches: list[deque] = []
        self.held: list[set[int]] = []
        self.sizes: list[int] = []
        self.running: list[deque] = [deque() for _ in range(num_workers)]  # chunks in use, oldest first
        self.seq = [0] * num_workers
        shared_per_worker = int(num_blocks * SHARED_FRACTION) // PREFIX_BLOCKS
        for _ in range(num_workers):
            held = set()
            while len(held) < shared_per_worker:
                held.add(self.popular_prefix())
            chunks = [(self.prefixes[p], p) for p in held]
            unique = num_blocks - len(held) * PREFIX_BLOCKS
            while unique > 0:
                n = min(unique, rng.randint(4, 128))
                chunks.append((os.urandom(n * HASH_SIZE), None))
                unique -= n
            rng.shuffle(chunks)
            self.caches.append(deque(chunks))
            self.held.append(held)
            self.sizes.append(num_blocks)

    def popular_prefix(self) -> int:
        return self.rng.choices(range(NUM_PREFIXES), cum_weights=self.cum_weights)[0]

    def snapshot(self, w: int) -> KVSnapshot:
        blob = b"".join(chunk for chunk, _ in self.caches[w])
        return KVSnapshot(f"w{w}", 0, blob, 2000, self.num_blocks, 32, 4, 1500)

    def step_batch(self, w: int) -> KVEventBatch:
        rng = self.rng
        stored = []
        acquired = []
        if rng.random() < 0.7:
            stored.append((os.urandom(rng.randint(4, 16) * HASH_SIZE), None))
        else:
            n = rng.randint(32, 128)
            if rng.random() < 0.5:
                p = self.popular_prefix()
                if p not in self.held[w]:
                    stored.append((self.prefixes[p], p))
                else:
                    acquired.append(self.prefixes[p])
                n -= PREFIX_BLOCKS
            stored.append((os.urandom(n * HASH_SIZE), None))
        running = self.running[w]
        running.extend(acquired)
        running.extend(chunk for chunk, _ in stored)
        released = [running.popleft() for _ in range(len(running) - RUNNING_CHUNKS)]
        num_new = sum(len(c) for c, _ in stored) // HASH_SIZE
        removed = []
        cache = self.caches[w]
        freed = 0
        while self.sizes[w] - freed + num_new > self.num_blocks:  # evict the oldest chunks until the new fit
            chunk, p = cache.popleft()
            removed.append(chunk if not self.tail_first else
                           b"".join(chunk[i:i + HASH_SIZE] for i in range(len(chunk) - HASH_SIZE, -1, -HASH_SIZE)))
            freed += len(chunk) // HASH_SIZE
            if p is not None:
                self.held[w].discard(p)
        for chunk, p in stored:
            cache.append((chunk, p))
            if p is not None:
                self.held[w].add(p)
        self.sizes[w] += num_new - freed
        self.seq[w] += 1
        blob = b"".join(c for c, _ in stored)
        parents = ROOT_HASH + blob[:-HASH_SIZE] if blob else b""  # each block's parent is the one before it
        tokens = pack_token_ids([rng.randrange(32000) for _ in range(BLOCK_SIZE)] * num_new)
        return KVEventBatch(f"w{w}", self.seq[w], self.seq[w], False, blob, parents, tokens, b"".join(removed),
                            num_free_blocks=rng.randint(0, 4000), num_total_blocks=self.num_blocks,
                            num_running=rng.randint(8, 64), num_waiting=rng.randint(0, 8),
                            num_reserved_blocks=rng.randint(0, 3000), acquired=b"".join(acquired),
                            released=b"".join(released))

    def prompt(self, rid: int) -> RouteRequest:
        rng = self.rng
        kind = rng.random()
        if kind < 0.4:  # a popular system prompt and a new question
            head = self.prefixes[self.popular_prefix()]
        elif kind < 0.7:  # a conversation going on: 96 blocks one worker holds
            cache = self.caches[rng.randrange(len(self.caches))]
            chunks = [c for c, p in list(cache)[-64:] if p is None]
            head = b"".join(chunks)[-96 * HASH_SIZE:]
        else:
            head = b""
        blob = head + os.urandom((PROMPT_BLOCKS - len(head) // HASH_SIZE) * HASH_SIZE)
        return RouteRequest(f"r{rid}", blob, num_blocks=PROMPT_BLOCKS + 4)


def num_events(b: KVEventBatch) -> int:
    """Hashes the batch reports: stored, removed, acquired, released."""
    return (len(b.stored) + len(b.removed) + len(b.acquired) + len(b.released)) // HASH_SIZE


def feed_updates(batches: list[KVEventBatch], per_update: int) -> list[ViewUpdate]:
    """The batches as a copy of the view receives them: slimmed, ``per_update`` to a feed update."""
    slimmed = [slim(b) for b in batches]
    return [ViewUpdate("bench", start + len(chunk) - 1, chunk)
            for start in range(0, len(slimmed), per_update) for chunk in (slimmed[start:start + per_update],)]


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--batches", type=int, default=40_000)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--batches-per-update", type=int, default=None,
                    help="batches in each feed update the ingress's copy applies (default: half the workers: "
                         "what a copy polling every 100 ms gets from workers publishing every 200 ms)")
    ap.add_argument("--evict-order", choices=["arrival", "tail-first"], default="arrival",
                    help="the order of an evicted chunk's blocks: as they were stored, or last first (as the "
                         "engine frees a finished request's blocks, so its pool evicts them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--index", choices=["native", "python"], default="native",
                    help="the compiled KV index or the pure-Python reference")
    ap.add_argument("--notes", default="", help="what else ran on the machine meanwhile (goes in every line)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    config = {"workers": args.workers, "blocks_per_worker": args.blocks, "block_size": BLOCK_SIZE,
              "shared_prefixes": NUM_PREFIXES, "shared_fraction": SHARED_FRACTION, "index": args.index,
              "evict_order": args.evict_order,
              **({"notes": args.notes} if args.notes else {})}

    t0 = time.perf_counter()
    fleet = Fleet(args.workers, args.blocks, rng, tail_first=args.evict_order == "tail-first")
    snapshots = [fleet.snapshot(w) for w in range(args.workers)]
    gen_s = time.perf_counter() - t0

    gs = GlobalScheduler(prediction_ttl_s=2.0, liveness_timeout_s=1e9, index_kind=args.index)
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    for snap in snapshots:
        gs.apply_snapshot(snap, now=0.0)
    fill_s = time.perf_counter() - t0
    gc.collect()
    entries = gs.index.num_entries()
    state_bytes = rss_bytes() - rss0  # with the snapshots still held: freeing them first could hand pages back
    del snapshots
    print(json.dumps({"result": "rebuild_from_snapshots", **config, "entries": entries,
                      "distinct_blocks": len(gs.index), "seconds": round(fill_s, 2),
                      "entries_per_s": round(entries / fill_s)}), flush=True)

    # One stream of batches, applied along two paths: as each ingress's copy of the view applies
    # them (SchedulerMirror.apply of a feed update holding many batches) and as the actor does (one
    # publish call, one apply_batch, per batch); each handed over as objects (the core alone) and as
    # pickles (what arrives: unpickling is part of the work). The four take turns over the stream, so
    # that a shared machine's busy moments fall on all of them alike.
    per_update = args.batches_per_update or max(1, args.workers // 2)
    mirror = SchedulerMirror(weight=gs.weight)
    mirror.core = gs  # the copy's apply, over the core measured here
    batches = [fleet.step_batch(rng.randrange(args.workers)) for _ in range(args.batches)]
    paths = {name: [0, 0.0, 0.0] for name in ("batch", "batch_wire", "update", "update_wire")}  # events, wall, CPU
    turn = -(-len(batches) // (4 * INGEST_TURNS))
    for start in range(0, len(batches), 4 * turn):
        chunks = [batches[start + i * turn:start + (i + 1) * turn] for i in range(4)]
        work = {"batch": chunks[0], "batch_wire": [pickle.dumps(b, protocol=5) for b in chunks[1]],
                "update": feed_updates(chunks[2], per_update),
                "update_wire": [pickle.dumps(u, protocol=5) for u in feed_updates(chunks[3], per_update)]}
        for name, chunk in zip(paths, chunks):
            paths[name][0] += sum(map(num_events, chunk))
        del chunks
        for name, items in work.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            if name == "batch":
                for b in items:
                    gs.apply_batch(b, now=1.0)
            elif name == "batch_wire":
                for data in items:
                    gs.apply_batch(pickle.loads(data), now=1.0)
            elif name == "update":
                for update in items:
                    mirror.apply(update, now=1.0)
            else:
                for data in items:
                    mirror.apply(pickle.loads(data), now=1.0)
            paths[name][1] += time.perf_counter() - t0
            paths[name][2] += time.thread_time() - c0
        del work
    if gs.counters.gaps or gs.counters.batches != args.batches:
        raise RuntimeError(f"the stream was not applied in order: {gs.counters}")
    rates = {}
    for name, key in (("update", "update"), ("update_wire", "update_with_unpickle"), ("batch", "core"),
                      ("batch_wire", "with_unpickle")):
        events, wall, cpu_s = paths[name]
        rates[f"{key}_events_per_s"] = round(events / wall)
        rates[f"{key}_events_per_cpu_s"] = round(events / cpu_s)
    print(json.dumps({"result": "ingest", **config, "batches": args.batches,
                      "events_per_batch": round(sum(events for events, _, _ in paths.values()) / args.batches, 1),
                      "paths": {"update": f"an ingress's copy: SchedulerMirror.apply of feed updates of {per_update} "
                                          "batches (one call into the index each)",
                                "core": "the actor: apply_batch per batch (one publish call each)"},
                      "batches_per_update": per_update, **rates, "target_events_per_s": 5_000_000}), flush=True)
    del batches

    lat, cpu = [], []
    hits = 0
    now = 3.0
    for i in range(args.decisions):
        for _ in range(2):  # the fleet keeps publishing while routers ask
            gs.apply_batch(fleet.step_batch(rng.randrange(args.workers)), now=now)
        req = fleet.prompt(i)
        t0, c0 = time.perf_counter(), time.thread_time()
        decision = gs.route(req, now=now)
        lat.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        hits += decision.predicted_hit_blocks > 0
        now += 0.0005  # 2,000 decisions per second
    lat.sort()
    cpu.sort()
    print(json.dumps({"result": "decision", **config, "prompt_blocks": PROMPT_BLOCKS, "decisions": args.decisions,
                      "with_cached_prefix": round(hits / args.decisions, 3),
                      "live_predictions": len(gs.predictions.by_request),
                      "p50_ms": round(percentile(lat, 0.5) * 1e3, 3), "p99_ms": round(percentile(lat, 0.99) * 1e3, 3),
                      "max_ms": round(lat[-1] * 1e3, 3), "cpu_p50_ms": round(percentile(cpu, 0.5) * 1e3, 3),
                      "cpu_p99_ms": round(percentile(cpu, 0.99) * 1e3, 3),
                      "target_p99_ms": 0.5 if args.workers <= 256 else 1.0}), flush=True)

    gc.collect()
    entries_now = gs.index.num_entries()
    print(json.dumps({"result": "memory", **config, "entries": entries, "state_rss_bytes": state_bytes,
                      "bytes_per_entry": round(state_bytes / entries, 1), "entries_after_churn": entries_now,
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "target_bytes_per_entry": 48}), flush=True)
    print(json.dumps({"result": "machine", **machine(), "workload_generation_s": round(gen_s, 1),
                      **({"notes": args.notes} if args.notes else {})}), flush=True)


if __name__ == "__main__":
    main()
