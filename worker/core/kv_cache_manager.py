"""Per-sequence block tables over the shared block pool, with automatic prefix caching.

With a sliding window in every layer (``sliding_window`` W), a query at position p reads keys
from p - W + 1 on, so once a sequence has computed ``n`` tokens no later query reads a block
wholly before token n - W + 1: the manager gives such blocks back to the pool as vLLM's
sliding-window manager does. Their table entries stay (the ids are stale and no attention kernel
reads them), so a table keeps one entry per block of the sequence; ``_num_skipped`` counts the
leading entries no longer held. A freed full block keeps its hash: until evicted it is still a
prefix-cache hit for the next prompt that starts the same way, and a hit needs only the blocks
its own window reads (``NULL_BLOCK`` stands in for evicted ones before it, as in vLLM)."""

from __future__ import annotations

from typing import NamedTuple

from pagefleet.worker.core.block_hash import block_hashes
from pagefleet.worker.core.block_pool import BlockPool, KVBlock
from pagefleet.worker.core.sequence import Sequence

# Stands in, in a table, for a block before the window that the prefix cache no longer holds:
# never held (a free of it fails loudly, its ref count being 0), and its id is never read.
NULL_BLOCK = KVBlock(0)


class PrefixHit(NamedTuple):
    blocks: list[KVBlock]
    num_tokens: int


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window  # set only where every layer slides (model_config)
        self._num_skipped: dict[int, int] = {}  # leading table entries given back (out of the window)
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
        A sequence forked from a running parent shares the parent's prompt blocks instead, unless
        the parent gave back blocks that the child's window still reads."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = seq.parent
        if parent is not None and parent.seq_id in self.block_tables:
            shared = min(max_blocks, parent.num_computed_tokens // self.block_size,
                         seq.num_prompt_tokens // self.block_size)
            if self._num_skipped.get(parent.seq_id, 0) <= self.num_skipped_blocks(shared * self.block_size):
                blocks = self.block_tables[parent.seq_id][:shared]
                return PrefixHit(blocks, len(blocks) * self.block_size)
        if not self.pool.enable_caching or seq.params.prompt_logprobs is not None:
            return PrefixHit([], 0)  # prompt logprobs need every prompt position computed (as vLLM)
        hit = self._cached_prefix(self._hashes(seq)[:max_blocks])
        return PrefixHit(hit, len(hit) * self.block_size)

    def _cached_prefix(self, hashes: list) -> list[KVBlock]:
        """The blocks of the longest prefix of ``hashes`` whose KV the queries after it can read: all
        of it cached, or, with a window, all from the first block that window reads (NULL_BLOCK in
        the place of evicted blocks before it)."""
        hit: list[KVBlock] = []
        best = run_start = 0  # the longest valid prefix; the first block of the current cached run
        for i, h in enumerate(hashes):
            block = self.pool.lookup(h)
            if block is None:
                if self.sliding_window is None:
                    break
                hit.append(NULL_BLOCK)
                run_start = i + 1
                continue
            hit.append(block)
            if run_start <= self.num_skipped_blocks((i + 1) * self.block_size):
                best = i + 1
        return hit[:best]

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones. False when the
        pool cannot hold them: nothing changed then, but blocks that left the window are freed."""
        table = self.block_tables.get(seq.seq_id, [])
        hit = prefix.blocks if prefix else []
        num_computed = prefix.num_tokens if prefix else seq.num_computed_tokens
        self._free_skipped(seq.seq_id, table, num_computed)
        # A hit's blocks before the window are listed, never taken: no query of this sequence reads them.
        skipped_hit = min(len(hit), self.num_skipped_blocks(num_computed)) if hit else 0
        held_hit = hit[skipped_hit:]
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(table) - len(hit)
        if needed + self.pool.num_evictable(held_hit) > self.pool.num_free:
            return False
        if held_hit:
            self.pool.touch(held_hit)
        if skipped_hit:
            self._num_skipped[seq.seq_id] = skipped_hit
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
        # Never a block given back: another sequence may hold it by now.
        start = max(self._num_published.get(seq.seq_id, 0), self._num_skipped.get(seq.seq_id, 0))
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

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query after ``num_computed_tokens`` computed tokens reads."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _free_skipped(self, seq_id: int, table: list[KVBlock], num_computed_tokens: int) -> None:
        """Give back the blocks of ``table`` that fell out of the window, newest first (as ``free``)."""
        done = self._num_skipped.get(seq_id, 0)
        end = min(self.num_skipped_blocks(num_computed_tokens), len(table))
        if end > done:
            self.pool.free(table[end - 1:done - 1 if done else None:-1])
            self._num_skipped[seq_id] = end

    def held_blocks(self, seq_id: int) -> list[KVBlock]:
        """The blocks a sequence holds a reference on: its table less those given back."""
        return self.block_tables.get(seq_id, [])[self._num_skipped.get(seq_id, 0):]

    def held_block_tables(self) -> dict[int, list[KVBlock]]:
        """``held_blocks`` of every sequence with a table (the tables themselves without a window)."""
        if self.sliding_window is None:
            return self.block_tables
        return {seq_id: self.held_blocks(seq_id) for seq_id in self.block_tables}

    def withdraw_step(self, seq: Sequence) -> None:
        """Withdraw the hashes ``seq``'s allocations published this step: it leaves the step
        before it runs (preempted after it was scheduled), so their KV is never written."""
        mine = [block for seq_id, block in self._step_published if seq_id == seq.seq_id]
        for block in mine:
            self.pool.uncache(block)
        self._step_published = [(seq_id, block) for seq_id, block in self._step_published if seq_id != seq.seq_id]

    def free(self, seq: Sequence) -> None:
        table = self.block_tables.pop(seq.seq_id, None)
        self._block_ids.pop(seq.seq_id, None)
        self._num_published.pop(seq.seq_id, None)
        skipped = self._num_skipped.pop(seq.seq_id, 0)
        if table:
            self.pool.free(list(reversed(table[skipped:])))

    def block_ids(self, seq: Sequence) -> list[int]:
        """The sequence's block ids, in order: the manager's own list, which grows as the
        sequence does (callers read it, never change it), and a new list after the sequence
        is freed and allocated again."""
        return self._block_ids.get(seq.seq_id, [])
