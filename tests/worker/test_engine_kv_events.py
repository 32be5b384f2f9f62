"""The engine's KV events with a real (tiny) model: hashes from the caller, load, snapshots."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams
from pagefleet.worker.core.block_hash import (
    ROOT_HASH,
    block_hashes,
    extra_keys_digest,
    hash_block,
    pack_hashes,
    unpack_hashes,
)
from pagefleet.worker.core.kv_events import KVLoad, Release, unpack_releases
from pagefleet.worker.engine.llm_engine import LLMEngine

PROMPT = list(range(10, 50))  # 40 tokens: 2 full blocks of 16


@pytest.fixture(scope="module")
def args(tiny_checkpoint):
    return EngineArgs(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_bytes=2 << 20)


def test_the_engine_publishes_the_hashes_it_was_given_and_counts_its_load(args):
    engine = LLMEngine(args)
    engine.enable_kv_events("w0")
    # Hashes the ingress would have computed. Deliberately not the real ones: what comes out
    # shows the engine used them instead of hashing the prompt again.
    given = [bytes([1]) * 16, bytes([2]) * 16]
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=10, ignore_eos=True), ("salt",), pack_hashes(given))
    assert engine.kv_load() == KVLoad(num_running=0, num_waiting=1, num_reserved_blocks=4)  # 50 tokens = 4 blocks
    first = engine.drain_kv_events()
    assert (first.seq, first.cleared, first.added, first.stored) == (0, True, ["r"], b"")
    out = [t for d in engine.step() for c in d.sequences for t in c.token_ids]  # the prefill: 40 tokens, 3 blocks
    batch = engine.drain_kv_events()
    assert unpack_hashes(batch.stored) == given and unpack_hashes(batch.stored_parents) == [ROOT_HASH, given[0]]
    assert (batch.num_running, batch.num_waiting, batch.num_reserved_blocks) == (1, 0, 1)
    assert batch.num_free_blocks == batch.num_total_blocks - 3
    # it ends within 9 more steps (1 of its 10 tokens is out) and then frees its 4 blocks; the
    # step it took is timed
    assert unpack_releases(batch.releases) == [Release(steps=9, seqs=1, blocks=4)] and batch.step_time_s > 0
    later = []
    while engine.has_unfinished():
        out += [t for d in engine.step() for c in d.sequences for t in c.token_ids]
        later.append(engine.drain_kv_events())
    assert later[-1].num_free_blocks == later[-1].num_total_blocks and later[-1].num_reserved_blocks == 0
    # the block the output filled (tokens 32..47) the engine hashed itself, chained to the given ones
    tokens = PROMPT + out
    stored = [h for b in later for h in unpack_hashes(b.stored)]
    assert stored == [hash_block(given[1], tokens[32:48], extra_keys_digest(("salt",)))]
    with pytest.raises(RuntimeError, match="before the engine takes requests"):
        engine.enable_kv_events("again")


def test_without_given_hashes_the_engine_hashes_with_the_salt(args):
    engine = LLMEngine(args)
    engine.enable_kv_events("w0")
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=1), ("tenant",))
    engine.step()
    assert unpack_hashes(engine.drain_kv_events().stored) == block_hashes(PROMPT, 16, extra_keys_digest(("tenant",)))
    assert engine.drain_kv_events() is not None and LLMEngine(args).drain_kv_events() is None  # off by default


def test_async_engine_streams_batches_in_order_and_a_snapshot_leaves_no_gap(args):
    async def run():
        engine = AsyncLLMEngine(args)
        batches = []
        engine.enable_kv_events("w0", batches.append)
        try:
            async for _ in engine.generate("a", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)):
                pass
            snapshot = await engine.kv_snapshot()
            await asyncio.sleep(0.05)
        finally:
            engine.shutdown()
        return batches, snapshot

    batches, snapshot = asyncio.run(run())
    assert [b.seq for b in batches] == list(range(len(batches)))  # one numbered stream, nothing missing
    assert batches[0].cleared and "a" in [rid for b in batches for rid in b.added]
    assert snapshot.seq in [b.seq for b in batches]  # the batch the snapshot was taken at went out too
    assert set(unpack_hashes(snapshot.block_hashes)) == set(block_hashes(PROMPT, 16))
    assert snapshot.num_free_blocks == snapshot.num_total_blocks


def test_steps_while_the_sink_is_not_ready_go_out_as_one_batch_when_it_is(args):
    """A publisher sends at most every so often: the engine drains its event log only when a
    batch would go out, so the steps between cost no batch each and nothing is lost."""
    async def run():
        engine = AsyncLLMEngine(args)
        batches, ready = [], [False]
        engine.enable_kv_events("w0", batches.append, lambda: ready[0])
        try:
            async for _ in engine.generate("a", PROMPT + PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)):
                ready[0] = False  # (no step drains: only the idle engine's publish, below)
            # The engine thread hands a's last delta on before it finds itself idle and publishes:
            # wait for that publish, still not ready.
            deadline = time.monotonic() + 10
            while not batches and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            steps_batches = list(batches)
            ready[0] = True
            async for _ in engine.generate("b", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)):
                pass
            await asyncio.sleep(0.05)
        finally:
            engine.shutdown()
        return steps_batches, batches

    not_ready, batches = asyncio.run(run())
    # while not ready, only the idle engine's batches went out (it publishes at least every second
    # then): the first holds all of a's 6 steps, "a" taken in and the 5 full blocks of its 86 tokens
    assert {b.num_running for b in not_ready} == {0}
    assert not_ready[0].added == ["a"] and unpack_hashes(not_ready[0].stored) == block_hashes(PROMPT + PROMPT, 16)
    assert [b.seq for b in batches] == list(range(len(batches)))  # one numbered stream, nothing missing
    # ready: a batch after each of b's 3 steps (its prefill, a decode, the decode that ends it)
    after = batches[len(not_ready):len(not_ready) + 3]
    assert [(b.added, b.num_running) for b in after] == [(["b"], 1), ([], 1), ([], 0)]
