"""Per-sequence block tables over the shared block pool, with automatic prefix caching."""

from __future__ import annotations

from typing import NamedTuple

from pagefleet.worker.core.block_hash import block_hashes
from pagefleet.worker.core.block_pool import BlockPool, KVBlock
from pagefleet.worker.core.sequence import Sequence


class PrefixHit(NamedTuple):
    blocks: list[KVBlock]
    num_tokens: int


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.block_tables: dict[int, list[KVBlock]] = {}
        # The same tables as block ids, extended in place: a step's block table is these lists
        # as they are (``block_ids``), and one that did not change is seen not to
        # (``StepBuffers._write_table``).
        self._block_ids: dict[int, list[int]] = {}
        self._num_published: dict[int, int] = {}  # leading blocks of each table already hashed into the pool
        # Hashes are published when blocks are allocated, so later sequences of the same step
        # can share them (each layer writes its KV before attention reads it); if the step
        # fails, these must be withdrawn since their KV was never written.
        self._step_published: list[tuple[int, KVBlock]] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0     # of those, tokens found

    def _hashes(self, seq: Sequence) -> list:
        # Computed once per full block and kept on the sequence.
        if len(seq.block_hashes) < seq.num_tokens // self.block_size:
            seq.block_hashes = block_hashes(seq.token_ids, self.block_size, seq.extra_digest, seq.block_hashes)
        return seq.block_hashes

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """Longest run of cached leading blocks; never covers the last token (its logits are needed).
        A sequence forked from a running parent shares the parent's prompt blocks instead."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = seq.parent
        if parent is not None and parent.seq_id in self.block_tables:
            shared = min(max_blocks, parent.num_computed_tokens // self.block_size,
                         seq.num_prompt_tokens // self.block_size)
            blocks = self.block_tables[parent.seq_id][:shared]
            return PrefixHit(blocks, len(blocks) * self.block_size)
        if not self.pool.enable_caching or seq.params.prompt_logprobs is not None:
            return PrefixHit([], 0)  # prompt logprobs need every prompt position computed (as vLLM)
        hit: list[KVBlock] = []
        for h in self._hashes(seq)[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        return PrefixHit(hit, len(hit) * self.block_size)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.
        False (and nothing changed) when the pool cannot hold them."""
        table = self.block_tables.get(seq.seq_id, [])
        hit = prefix.blocks if prefix else []
        num_computed = prefix.num_tokens if prefix else seq.num_computed_tokens
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(table) - len(hit)
        if needed + self.pool.num_evictable(hit) > self.pool.num_free:
            return False
        if hit:
            self.pool.touch(hit)
        new = self.pool.allocate(max(needed, 0))
        table = table + hit + new
        self.block_tables[seq.seq_id] = table
        ids = self._block_ids.setdefault(seq.seq_id, [])
        ids.extend(b.block_id for b in hit)
        ids.extend(b.block_id for b in new)
        if prefix is not None:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += prefix.num_tokens
        self._publish_full_blocks(seq, table, num_computed + num_new_tokens)
        return True

    def _publish_full_blocks(self, seq: Sequence, table: list[KVBlock], num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        hashes = self._hashes(seq)
        start = self._num_published.get(seq.seq_id, 0)
        end = min(num_tokens // self.block_size, len(hashes))
        events = self.pool.events is not None
        bs = self.block_size
        for i in range(start, end):
            # Parent and tokens only feed the event log; skip the slicing without one.
            parent, tokens = (hashes[i - 1] if i else None, seq.token_ids[i * bs:(i + 1) * bs]) if events else (None, ())
            if self.pool.cache(table[i], hashes[i], parent, tokens):
                self._step_published.append((seq.seq_id, table[i]))
        self._num_published[seq.seq_id] = max(start, end)

    def commit_step(self) -> None:
        self._step_published.clear()

    def unpublish_step(self) -> None:
        for seq_id, block in self._step_published:
            self.pool.uncache(block)
            self._num_published.pop(seq_id, None)  # republished from the start when it runs again
        self._step_published.clear()

    def free(self, seq: Sequence) -> None:
        table = self.block_tables.pop(seq.seq_id, None)
        self._block_ids.pop(seq.seq_id, None)
        self._num_published.pop(seq.seq_id, None)
        if table:
            self.pool.free(list(reversed(table)))

    def block_ids(self, seq: Sequence) -> list[int]:
        """The sequence's block ids, in order: the manager's own list, which grows as the
        sequence does (callers read it, never change it), and a new list after the sequence
        is freed and allocated again."""
        return self._block_ids.get(seq.seq_id, [])
