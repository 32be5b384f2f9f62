"""The KV manager with a sliding window in every layer gives back the blocks that leave the window
(exact block ids and pool counts), a prefix hit takes only the blocks inside its window, and a
long generation of a windowed model runs in a pool far smaller than the sequence."""

from __future__ import annotations

import pytest

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.block_hash import block_hashes
from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.model_executor.model_config import load_model_config

from hf_reference import hf_greedy

BS, WINDOW = 4, 6


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_blocks_outside_the_window_are_freed_and_a_prefix_hit_skips_them():
    pool = BlockPool(10)
    kv = KVCacheManager(pool, BS, sliding_window=WINDOW)
    params = SamplingParams(max_tokens=8)
    seq = Sequence(0, "a", 0, list(range(20)), params)
    assert kv.allocate(seq, 20, kv.find_prefix(seq))  # the prompt: no query has passed a window yet
    assert kv.block_ids(seq) == [0, 1, 2, 3, 4] and pool.num_free == 5
    seq.num_computed_tokens = 20
    seq.append_token(7)
    # Token 20 and every later one see positions 15 on: blocks 0..2 (tokens 0..11) go back, newest
    # first, still cached; block 3 (tokens 12..15) stays.
    assert kv.allocate(seq, 1)
    assert kv.block_ids(seq) == [0, 1, 2, 3, 4, 5]
    assert _ids(kv.held_blocks(0)) == [3, 4, 5]
    assert pool.num_free == 7
    assert _ids(pool.free_queue) == [6, 7, 8, 9, 2, 1, 0]
    assert all(pool.blocks[i].block_hash is not None and pool.blocks[i].ref_cnt == 0 for i in (0, 1, 2))
    seq.num_computed_tokens = 21
    seq.append_token(8)
    # Token 21 sees 16 on: block 3 goes too.
    assert kv.allocate(seq, 1) and _ids(kv.held_blocks(0)) == [4, 5] and pool.num_free == 8
    assert _ids(pool.free_queue) == [6, 7, 8, 9, 2, 1, 0, 3]
    kv.free(seq)
    assert pool.num_free == 10 and not kv.held_blocks(0)

    # The same prompt again: all five blocks are cached hits, but its first query (position 20)
    # sees 15..20, so blocks 0..2 are listed (never read) and only 3 and 4 are taken.
    second = Sequence(1, "b", 0, list(range(20)) + [99], params)
    hit = kv.find_prefix(second)
    assert hit.num_tokens == 20 and _ids(hit.blocks) == [0, 1, 2, 3, 4]
    assert kv.allocate(second, 1, hit)
    assert kv.block_ids(second) == [0, 1, 2, 3, 4, 6]
    assert _ids(kv.held_blocks(1)) == [3, 4, 6]
    assert [b.ref_cnt for b in pool.blocks[:7]] == [0, 0, 0, 1, 1, 0, 1]
    assert pool.num_free == 7
    kv.free(second)
    assert pool.num_free == 10 and all(b.ref_cnt == 0 for b in pool.blocks)


def _cached_prompt(kv: KVCacheManager, tokens: list[int]) -> None:
    """Compute ``tokens`` as a prompt and end the sequence: its full blocks stay cached, idle."""
    seq = Sequence(99, "cached", 0, tokens, SamplingParams(max_tokens=1))
    assert kv.allocate(seq, len(tokens), kv.find_prefix(seq))
    kv.free(seq)


@pytest.mark.parametrize("window", [WINDOW, None])
def test_a_hit_needs_only_the_blocks_its_window_reads(window):
    pool = BlockPool(10)
    kv = KVCacheManager(pool, BS, sliding_window=window)
    _cached_prompt(kv, list(range(20)))  # blocks 0..4
    pool.uncache(pool.blocks[0])  # evicted, as the oldest blocks of a windowed sequence go first
    pool.uncache(pool.blocks[1])
    seq = Sequence(1, "b", 0, list(range(20)) + [99], SamplingParams(max_tokens=4))
    hit = kv.find_prefix(seq)
    if window is None:
        assert hit.num_tokens == 0  # a hit starts at the prompt's first block
        return
    # Position 20 reads 15 on: blocks 3 and 4 (and 2 need not be there either).
    assert hit.num_tokens == 20 and _ids(hit.blocks) == [0, 0, 2, 3, 4] and hit.blocks[0] is NULL_BLOCK
    assert kv.allocate(seq, 1, hit)
    assert kv.block_ids(seq) == [0, 0, 2, 3, 4, 5] and _ids(kv.held_blocks(1)) == [3, 4, 5]
    assert [b.ref_cnt for b in pool.blocks[:6]] == [0, 0, 0, 1, 1, 1] and pool.num_free == 7
    kv.free(seq)
    assert pool.num_free == 10 and NULL_BLOCK.ref_cnt == 0


def test_a_hit_stops_where_its_window_would_read_an_evicted_block():
    pool = BlockPool(10)
    kv = KVCacheManager(pool, BS, sliding_window=WINDOW)
    _cached_prompt(kv, list(range(20)))
    pool.uncache(pool.blocks[3])  # tokens 12..15: a query at 16..20 reads some of them
    hit = kv.find_prefix(Sequence(1, "b", 0, list(range(20)) + [99], SamplingParams(max_tokens=4)))
    assert hit.num_tokens == 12 and _ids(hit.blocks) == [0, 1, 2]


def test_without_a_window_nothing_is_freed_early():
    pool = BlockPool(10)
    kv = KVCacheManager(pool, BS)
    seq = Sequence(0, "a", 0, list(range(20)), SamplingParams(max_tokens=8))
    assert kv.allocate(seq, 20, kv.find_prefix(seq))
    seq.num_computed_tokens = 20
    seq.append_token(7)
    assert kv.allocate(seq, 1)
    assert _ids(kv.held_blocks(0)) == [0, 1, 2, 3, 4, 5] and pool.num_free == 4


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="sliding_window must be at least 1 token, got 0"):
        KVCacheManager(BlockPool(4), BS, sliding_window=0)


def test_long_windowed_generation_runs_in_a_small_pool(tiny_checkpoint):
    # 7 blocks of 16 tokens (112 tokens) serve a 70-token prompt plus 130 tokens (13 blocks): a
    # sequence holds at most its 24-token window and one 32-token step (5 blocks).
    checkpoint = tiny_checkpoint("mistral", sliding_window=24)
    cfg = load_model_config(str(checkpoint))
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    llm = LLM(model=str(checkpoint), dtype="float32", kv_cache_bytes=7 * per_block, max_num_batched_tokens=32)
    assert llm.engine.pool.num_blocks == 7
    prompt = llm.tokenizer.encode("a much longer prompt about serving language models from a cluster " * 6)[:70]
    params = SamplingParams(temperature=0.0, max_tokens=130, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    assert out.token_ids == hf_greedy(str(checkpoint), tuple(prompt), 130)[0]
    stats = llm.engine.stats()
    assert stats.num_preemptions == 0
    assert stats.num_free_blocks == stats.num_total_blocks == 7


def test_a_hit_whose_first_blocks_were_evicted_gives_exact_output(tiny_checkpoint):
    checkpoint = tiny_checkpoint("mistral", sliding_window=24)
    llm = LLM(model=str(checkpoint), dtype="float32", kv_cache_bytes=32 << 20)
    prompt = llm.tokenizer.encode("a much longer prompt about serving language models from a cluster " * 6)[:70]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = hf_greedy(str(checkpoint), tuple(prompt), 20)[0]
    assert llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids == want
    # Forget the prompt's first two blocks (tokens 0..31), as eviction would: its 64-token hit
    # still stands, since the first query after it (position 64) reads 41 on.
    pool = llm.engine.pool
    for h in block_hashes(prompt, 16, b"")[:2]:
        pool.uncache(pool.lookup(h))
    again = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert again.num_cached_tokens == 64
    assert again.outputs[0].token_ids == want
