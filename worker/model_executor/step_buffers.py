"""A step's index tensors built in one pinned host buffer and sent to the device in one copy.

Building five or six tensors from Python lists costs as many small synchronous host-to-device
copies a step (pageable memory makes each one wait). Here every index a step needs is written
into fixed regions of one pinned int64 buffer, and the used prefix goes over in one
asynchronous copy; the device tensors are views of one device buffer at the same offsets.
Those addresses never change, which is also what lets a CUDA graph read them
(``cuda_graphs.DecodeGraphs``): a graph's inputs are these views, refilled each step.

The host buffer is rewritten only once the device has read the last copy out of it (an event
recorded after the copy): a step that samples nothing does not wait for its device work, and
the next step's indices must not overwrite what a queued copy has yet to read.

The block table is the step's largest input (a row per sequence, a column per block), and
from one step to the next a row gains a block at most. So the host buffer keeps its rows, and
a step writes only what changed (``_write_table``): a row holding the same sequence's table
as last step gets the new blocks; a row whose sequence moved up (one before it ended) is
copied from where it was; only a sequence new to the table is written whole. The tables come
from ``KVCacheManager.block_ids``: one list per sequence's allocation, only ever extended, so
the list object itself says whose table a row holds (the buffers keep a reference to each list
written, so no other list can take its id).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagefleet.worker.model_executor.model import AttentionMetadata


def take_prev_tokens(input_ids: torch.Tensor, rows: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """Write into a step's first ``len(rows)`` input ids the tokens the previous step sampled in
    those rows, on the device (async scheduling: the host does not have them yet).

    input_ids: [T]; rows: [K] int64, K <= T; prev_tokens: [S], the previous step's sampled tokens."""
    input_ids[:rows.numel()].copy_(prev_tokens.index_select(0, rows))


class StepTensors(NamedTuple):
    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64


class StepBuffers:
    """Regions, in order: input ids, positions, slots, logits indices (max_tokens each), query
    starts (max_seqs + 1), sequence lengths and the previous step's token rows (max_seqs each;
    ``StepInput.prev_token_rows``), then the block table,
    max_seqs rows of max_blocks. The block table comes last so that a step of B sequences
    sends only its B rows."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.device = device
        t, s = max_tokens, max_seqs
        self.off_ids, self.off_pos, self.off_slots, self.off_logits = 0, t, 2 * t, 3 * t
        self.off_qsl = 4 * t
        self.off_lens = self.off_qsl + s + 1
        self.off_prev = self.off_lens + s
        self.off_table = self.off_prev + s
        size = self.off_table + s * max_blocks
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.table_host = self.host_np[self.off_table:].reshape(max_seqs, max_blocks)
        # On CPU the host buffer is the device buffer: no copy at all.
        self.dev = torch.zeros(size, dtype=torch.int64, device=device) if pin else self.host
        self._sent: torch.cuda.Event | None = None  # recorded after the last copy out of the host buffer
        # Per table row: the block list written there last and how many of its blocks; None
        # where the row holds nothing a later step can reuse.
        self._row_lists: list[list[int] | None] = [None] * max_seqs
        self._row_lens = [0] * max_seqs
        self._row_of: dict[int, int] = {}  # id(list) -> its row, for the lists in _row_lists

    # Device views at fixed addresses (what a captured graph reads).
    def input_ids(self, n: int) -> torch.Tensor:
        return self.dev[self.off_ids:self.off_ids + n]

    def positions(self, n: int) -> torch.Tensor:
        return self.dev[self.off_pos:self.off_pos + n]

    def slot_mapping(self, n: int) -> torch.Tensor:
        return self.dev[self.off_slots:self.off_slots + n]

    def query_start_loc(self, b: int) -> torch.Tensor:
        return self.dev[self.off_qsl:self.off_qsl + b + 1]

    def seq_lens(self, b: int) -> torch.Tensor:
        return self.dev[self.off_lens:self.off_lens + b]

    def logits_indices(self, n: int) -> torch.Tensor:
        return self.dev[self.off_logits:self.off_logits + n]

    def prev_token_rows(self, k: int) -> torch.Tensor:
        return self.dev[self.off_prev:self.off_prev + k]

    def block_table(self, b: int) -> torch.Tensor:
        # [b, max_blocks]: full-width rows, so a kernel's row stride never changes; columns past a
        # row's blocks hold stale ids, which no kernel reads (seq_lens bound every read).
        return self.dev[self.off_table:self.off_table + b * self.max_blocks].view(b, self.max_blocks)

    def fits(self, step) -> bool:
        """Whether ``step`` (a StepInput) fits the regions (an engine's steps always do)."""
        return (len(step.input_ids) <= self.max_tokens and len(step.seq_lens) <= self.max_seqs
                and max(map(len, step.block_tables)) <= self.max_blocks)

    def fill(self, step, pad_to: int | None = None, pad_tokens: tuple[int, int] | None = None) -> int:
        """Write ``step`` (a StepInput) into the host buffer and send it; returns the
        sequence count the device views cover.

        ``pad_to``: a decode step (one token a sequence) padded to that many rows, each padding
        row one token at position 0 that writes no KV (slot -1) and reads one token of block 0, so
        its attention is finite and touches nothing.
        ``pad_tokens=(tokens, seqs)``: any step padded to that many tokens and sequences; the
        padding tokens write no KV and lie past the last sequence (attention leaves them
        unwritten), the padding sequences are empty (no query, no context)."""
        if self._sent is not None:
            self._sent.synchronize()  # the last copy has left the host buffer (at once, as a rule)
        h = self.host_np
        t, b = len(step.input_ids), len(step.seq_lens)
        if pad_tokens is not None:
            n, rows = pad_tokens
            h[self.off_qsl + b + 1:self.off_qsl + rows + 1] = t
            h[self.off_lens + b:self.off_lens + rows] = 0
        else:
            rows = pad_to if pad_to is not None else b
            n = rows if pad_to is not None else t
        h[self.off_ids:self.off_ids + t] = step.input_ids
        h[self.off_pos:self.off_pos + t] = step.positions
        h[self.off_slots:self.off_slots + t] = step.slot_mapping
        h[self.off_qsl:self.off_qsl + b + 1] = step.query_start_loc
        h[self.off_lens:self.off_lens + b] = step.seq_lens
        h[self.off_logits:self.off_logits + len(step.logits_indices)] = step.logits_indices
        if step.prev_token_rows:
            h[self.off_prev:self.off_prev + len(step.prev_token_rows)] = step.prev_token_rows
        if n > t:
            h[self.off_ids + t:self.off_ids + n] = 0
            h[self.off_pos + t:self.off_pos + n] = 0
            h[self.off_slots + t:self.off_slots + n] = -1
        if rows > b and pad_tokens is None:
            h[self.off_qsl + b + 1:self.off_qsl + rows + 1] = range(t + 1, t + 1 + rows - b)
            h[self.off_lens + b:self.off_lens + rows] = 1
        self._write_table(step.block_tables)
        if rows > b:
            self.table_host[b:rows, 0] = 0
            self._row_lists[b:rows] = [None] * (rows - b)
        if self.dev is not self.host:
            used = self.off_table + rows * self.max_blocks
            self.dev[:used].copy_(self.host[:used], non_blocking=True)
            self._sent = torch.cuda.Event()
            self._sent.record()
        return rows

    def _write_table(self, tables: list[list[int]]) -> None:
        """Bring the host table's leading rows to ``tables``, writing only what changed (module
        docstring). Rows that moved up by the same offset, as all those after an ended sequence
        do, are copied in one slice; every other write waits until the copies are done, so a
        copy reads only rows as the last step left them."""
        table, lists, lens, row_of = self.table_host, self._row_lists, self._row_lens, self._row_of
        writes = []  # (row, first column to write, blocks)
        moved = False  # a row took another list: row_of is rebuilt
        run_i = run_j = run_n = run_w = 0  # rows run_i.. take the first run_w columns of rows run_j..
        for i, blocks in enumerate(tables):
            if lists[i] is blocks:
                had = lens[i]
            else:
                j = row_of.get(id(blocks))
                # Row j still holds this list's blocks unless this step has rewritten it, and a
                # rewritten row holds another list.
                if j is not None and lists[j] is blocks:
                    had = lens[j]
                    if run_n and i == run_i + run_n and j == run_j + run_n:
                        run_n, run_w = run_n + 1, max(run_w, had)
                    else:
                        if run_n:
                            table[run_i:run_i + run_n, :run_w] = table[run_j:run_j + run_n, :run_w]
                        run_i, run_j, run_n, run_w = i, j, 1, had
                else:
                    had = 0
                lists[i] = blocks
                moved = True
            n = len(blocks)
            if n > had:
                writes.append((i, had, blocks))
            lens[i] = n
        if run_n:
            table[run_i:run_i + run_n, :run_w] = table[run_j:run_j + run_n, :run_w]
        for i, had, blocks in writes:
            table[i, had:len(blocks)] = blocks[had:] if had else blocks
        if moved:
            self._row_of = {id(x): i for i, x in enumerate(lists) if x is not None}

    def take_prev_tokens(self, step, prev_tokens: torch.Tensor | None) -> None:
        """After ``fill(step)``: the step's first input ids become the previous step's tokens
        (``take_prev_tokens``), its rows read from the buffers, so nothing waits on the host."""
        k = len(step.prev_token_rows)
        if k:
            take_prev_tokens(self.input_ids(k), self.prev_token_rows(k), prev_tokens)

    def tensors(self, step, plan_attention) -> StepTensors:
        """Fill and send an eager step; the views its forward reads."""
        t, b = len(step.input_ids), len(step.seq_lens)
        self.fill(step)
        block_table, seq_lens = self.block_table(b), self.seq_lens(b)
        meta = AttentionMetadata(slot_mapping=self.slot_mapping(t), block_table=block_table,
                                 query_start_loc=self.query_start_loc(b), seq_lens=seq_lens,
                                 attn_plan=plan_attention(block_table, seq_lens, step.query_start_loc,
                                                          step.seq_lens))
        return StepTensors(self.input_ids(t), self.positions(t), meta, self.logits_indices(len(step.logits_indices)))
