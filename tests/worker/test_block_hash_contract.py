"""A prompt's block hashes cross processes packed (``block_hash.pack_hashes``) and are unpacked
once, by the engine that takes the request in."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams
from pagefleet.worker.core.block_hash import (
    HASH_SIZE,
    PackedHashes,
    block_hashes,
    extra_keys_digest,
    pack_hashes,
    unpack_hashes,
)


def test_packed_hashes_read_in_place_equal_the_unpacked_list():
    hashes = block_hashes(list(range(50)), 16, extra_keys_digest(("tenant",)))
    packed = pack_hashes(hashes)
    assert len(packed) == 3 * HASH_SIZE and unpack_hashes(packed) == hashes
    view = PackedHashes(packed)
    assert (len(view), view[0], view[-1], list(view)) == (3, hashes[0], hashes[2], hashes)
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(ValueError, match="multiple of 16"):
        PackedHashes(packed[:-1])


def test_the_engine_uses_the_callers_hashes_and_refuses_bad_ones_before_queueing(tiny_checkpoint):
    engine = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32",
                                       kv_cache_bytes=16 << 20))
    prompt = list(range(5, 5 + 40))  # two full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def run(request_id, packed):
        return [d async for d in engine.generate(request_id, prompt, params, ("salt",), packed)]

    try:
        for bad in (b"x" * 17, b"x" * 48):  # not whole hashes; more hashes than full blocks
            with pytest.raises(ValueError, match="packed block hashes"):
                asyncio.run(run("bad", bad))
        assert engine.engine.requests == {}  # nothing reached the engine thread
        packed = pack_hashes(block_hashes(prompt, 16, extra_keys_digest(("salt",))))
        assert asyncio.run(run("good", packed))[-1].finished
        # the second request finds the first's blocks under the same hashes: a prefix-cache hit
        again = asyncio.run(run("again", packed))
        assert again[0].num_cached_tokens == 32
    finally:
        engine.shutdown()
