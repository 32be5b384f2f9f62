"""A worker's load as its KV events report it: the blocks its sequences will still take, and
when its running sequences will give blocks and seats back.

Plain functions over the scheduler's sequences and the block tables (no clock: the engine
passes the step time it measured). A global scheduler's copy of the worker reads room from
the first part; an ingress's admission control reads, from the second, when a full worker
will have room again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence as Seq

from pagefleet.worker.core.block_pool import KVBlock
from pagefleet.worker.core.kv_events import KVLoad, Release, pack_releases
from pagefleet.worker.core.sequence import Sequence


def final_tokens(seq: Sequence, max_model_len: int) -> int:
    """The tokens a sequence holds when it ends by length: its prompt plus ``max_tokens``
    (within ``max_model_len``)."""
    return min(max_model_len, seq.num_prompt_tokens + (seq.params.max_tokens or max_model_len))


def steps_left(seq: Sequence, max_model_len: int, max_num_batched_tokens: int) -> int:
    """Engine steps until a running sequence ends by length: one per token still to generate,
    plus the extra chunks of a prompt not yet computed (the step that computes its last chunk
    samples a token too)."""
    uncomputed = seq.num_tokens - seq.num_computed_tokens
    extra_chunks = max(-(-uncomputed // max_num_batched_tokens) - 1, 0)
    return max(final_tokens(seq, max_model_len) - seq.num_tokens, 1) + extra_chunks


def shared_blocks(table: Seq[KVBlock]) -> int:
    """Leading blocks another sequence holds too (a cached prefix, the prompt of ``n`` siblings):
    its end does not free them. Sharing is a prefix of the table, so this is a binary search."""
    lo, hi = 0, len(table)
    while lo < hi:
        mid = (lo + hi) // 2
        if table[mid].ref_cnt > 1:
            lo = mid + 1
        else:
            hi = mid
    return lo


def worker_load(running: Iterable[Sequence], waiting: Iterable[Sequence], block_tables: Mapping[int, Seq[KVBlock]],
                block_size: int, max_model_len: int, max_num_batched_tokens: int, step_time_s: float,
                max_blocks_held: int | None = None) -> KVLoad:
    """Sequences running and waiting; the blocks they will still take (each grows to
    ``final_tokens``, less the blocks it holds now); and, per number of steps left, the running
    sequences that end by then and the blocks their end frees (its final blocks less the shared
    ones: at least what it gives back, since a shared prefix is freed by whichever holder ends last).
    ``block_tables`` hold the blocks each sequence holds; ``max_blocks_held`` caps what one ever
    holds (a model sliding in every layer gives back what leaves its window)."""
    running, waiting = list(running), list(waiting)

    def final_blocks_of(seq: Sequence) -> int:
        final = -(-final_tokens(seq, max_model_len) // block_size)
        return final if max_blocks_held is None else min(final, max_blocks_held)

    reserved = 0
    ending: dict[int, list[int]] = {}  # steps left -> [sequences, blocks]
    for seq in running:
        table = block_tables.get(seq.seq_id, ())
        final_blocks = final_blocks_of(seq)
        reserved += max(final_blocks - len(table), 0)
        entry = ending.setdefault(steps_left(seq, max_model_len, max_num_batched_tokens), [0, 0])
        entry[0] += 1
        entry[1] += max(final_blocks - shared_blocks(table), 0)
    for seq in waiting:
        final_blocks = final_blocks_of(seq)
        reserved += max(final_blocks - len(block_tables.get(seq.seq_id, ())), 0)
    releases = pack_releases(Release(steps, seqs, blocks) for steps, (seqs, blocks) in sorted(ending.items()))
    return KVLoad(len(running), len(waiting), reserved, releases, step_time_s)
