"""Engine steps replayed as CUDA graphs, captured at start.

An eager step of a 32-layer model launches hundreds of kernels one by one from Python, and the
GPU waits on the host between them. A graph launches them all at once. Every graph runs the
model over the fixed-address views of ``StepBuffers`` (input ids, positions, slots, block
table, query starts, sequence lengths), so a step refills those buffers and replays the graph
of the smallest bucket that holds it (``StepGraphs.pick``, the one place a step's graph is
chosen). Padding writes no KV and is never sampled (``StepBuffers.fill``). Two families:

* ``DecodeGraphs``: steps of one token a sequence, by batch size (1, 2, 4, 8, then steps of 8
  up to max_num_seqs, as vLLM's); the graph includes the logits.
* ``PrefillGraphs``: any other step (prompts, prefill chunks, mixed batches), by token count,
  padded to max_num_seqs sequences (the padding ones empty); the logits of the few sampled rows
  are computed after the replay, eagerly, so one graph serves any number of them.

All graphs share one memory pool, captured largest first so smaller ones reuse its blocks; each
copies its output into a persistent buffer, so no graph keeps an output of its own alive.
``capture=False`` runs the very same static-buffer forward eagerly: the CPU tests hold it equal
to the engine's ordinary path, and the GPU check compares replay against it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

from pagefleet.worker.model_executor.model import AttentionMetadata
from pagefleet.worker.model_executor.step_buffers import StepBuffers
from pagefleet.worker.model_executor.step_input import StepInput, padding_step

logger = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_num_seqs (which is always the last)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, then powers of 2 and 1.5 times them (a padded step computes at
    most a third more than it needs), up to max_tokens (always the last)."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        if size >= 512 and size * 3 // 2 < max_tokens:
            sizes.append(size * 3 // 2)
        size *= 2
    return sizes + [max_tokens]


def capture_graphs(families: list, pool) -> None:
    """Capture every family's graphs into one memory pool, in the order given (the family with
    the largest steps first, so the pool's blocks are cut from its largest graph)."""
    for family in families:
        family.capture_all(pool)


class DecodeGraphs:
    kind, unit = "decode", "sequences"

    def __init__(self, model, kv_caches, buffers: StepBuffers, max_num_seqs: int, vocab_size: int,
                 capture: bool) -> None:
        self._setup(model, kv_caches, buffers, decode_buckets(max_num_seqs), capture)
        # [max_num_seqs, vocab] fp32: every bucket's logits land in its leading rows.
        self.logits = torch.empty(max_num_seqs, vocab_size, dtype=torch.float32, device=buffers.device)

    def _setup(self, model, kv_caches, buffers: StepBuffers, buckets: list[int], capture: bool) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.buckets = buckets
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` decode rows; None past the largest."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def _forward(self, rows: int) -> None:
        # The whole decode step over the buffers' first ``rows`` rows: one token a sequence.
        b = self.buffers
        meta = AttentionMetadata(slot_mapping=b.slot_mapping(rows), block_table=b.block_table(rows),
                                 query_start_loc=b.query_start_loc(rows), seq_lens=b.seq_lens(rows))
        hidden = self.model(b.input_ids(rows), b.positions(rows), meta, self.kv_caches)
        logits = self.model.compute_logits(hidden)
        if logits is not None:
            self.logits[:rows].copy_(logits)

    @torch.inference_mode()
    def capture_all(self, pool=None) -> None:
        """Capture every bucket's graph (CUDA), into ``pool`` (a new one if None)."""
        if not self.capture:
            return
        started = time.monotonic()
        device = self.buffers.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        stream = torch.cuda.Stream(device)
        for rows in reversed(self.buckets):
            self._fill_padding(rows)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up (kernel compiles, allocator) off the capture
                self._forward(rows)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(rows)
            self.graphs[rows] = graph
        torch.cuda.synchronize(device)
        self.capture_s = time.monotonic() - started
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        logger.info("captured %d %s CUDA graphs (%s 1..%d) in %.1f s, %.0f MiB", len(self.graphs), self.kind,
                    self.unit, self.buckets[-1], self.capture_s, self.pool_bytes / 2**20)

    def _fill_padding(self, rows: int) -> None:
        self.buffers.fill(padding_step(), pad_to=rows)

    @torch.inference_mode()
    def run(self, step, rows: int, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``step``: a decode StepInput of at most ``rows`` sequences -> its sampling rows' logits.
        ``prev_tokens``: as ``ModelRunner.execute``'s."""
        self.buffers.fill(step, pad_to=rows)
        self.buffers.take_prev_tokens(step, prev_tokens)
        if self.capture:
            self.graphs[rows].replay()
        else:
            self._forward(rows)
        n = len(step.seq_lens)
        if len(step.logits_indices) == n:  # one token a row: n sampled rows are rows 0..n-1
            return self.logits[:n]
        return self.logits.index_select(0, torch.tensor(step.logits_indices, device=self.logits.device))

    @torch.inference_mode()
    def run_greedy(self, steps: list, rows: int) -> Iterator[list[int]]:
        """Decode steps back to back, each taking the previous one's greedy tokens as its input:
        ``steps`` are the StepInputs of one window over the same sequences (the first with its
        input ids, the others with their positions, slots and lengths; their input ids unread).
        Every step is queued on the device at once; the argmax tokens of each come back as it
        finishes, so the caller checks step j while the device runs step j + 1."""
        b, n, k = self.buffers, len(steps[0].seq_lens), len(steps)
        device = b.device
        b.fill(steps[0], pad_to=rows)
        # [k, 3, n]: each later step's positions, slots and sequence lengths, sent in one copy.
        ahead = torch.tensor([[s.positions, s.slot_mapping, s.seq_lens] for s in steps], dtype=torch.int64,
                             device=device)
        tokens = torch.empty(k, n, dtype=torch.int64, device=device)
        on_gpu = device.type == "cuda"
        host = torch.empty(k, n, dtype=torch.int64, pin_memory=True) if on_gpu else tokens
        done = []
        for j in range(k):
            if j:
                b.positions(n).copy_(ahead[j, 0])
                b.slot_mapping(n).copy_(ahead[j, 1])
                b.seq_lens(n).copy_(ahead[j, 2])
                b.input_ids(n).copy_(tokens[j - 1])
            if self.capture:
                self.graphs[rows].replay()
            else:
                self._forward(rows)
            torch.argmax(self.logits[:n], dim=-1, out=tokens[j])
            if on_gpu:
                host[j].copy_(tokens[j], non_blocking=True)
                done.append(torch.cuda.Event())
                done[-1].record()
        for j in range(k):
            if on_gpu:
                done[j].synchronize()
            yield host[j].tolist()


class PrefillGraphs(DecodeGraphs):
    kind, unit = "prefill and mixed", "tokens"

    def __init__(self, model, kv_caches, buffers: StepBuffers, max_num_seqs: int, hidden_size: int,
                 capture: bool) -> None:
        self._setup(model, kv_caches, buffers, token_buckets(buffers.max_tokens), capture)
        self.max_num_seqs = max_num_seqs
        # [max_tokens, hidden]: the final hidden states of every bucket's tokens.
        self.hidden = torch.empty(buffers.max_tokens, hidden_size, dtype=model.embed_tokens.weight.dtype,
                                  device=buffers.device)

    def _forward(self, tokens: int) -> None:
        b, seqs = self.buffers, self.max_num_seqs
        meta = AttentionMetadata(slot_mapping=b.slot_mapping(tokens), block_table=b.block_table(seqs),
                                 query_start_loc=b.query_start_loc(seqs), seq_lens=b.seq_lens(seqs))
        self.hidden[:tokens].copy_(self.model(b.input_ids(tokens), b.positions(tokens), meta, self.kv_caches))

    def _fill_padding(self, tokens: int) -> None:
        self.buffers.fill(padding_step(), pad_tokens=(tokens, self.max_num_seqs))

    @torch.inference_mode()
    def run(self, step, tokens: int, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """``step``: any StepInput of at most ``tokens`` tokens and max_num_seqs sequences -> its
        sampling rows' logits. ``prev_tokens``: as ``ModelRunner.execute``'s."""
        self.buffers.fill(step, pad_tokens=(tokens, self.max_num_seqs))
        self.buffers.take_prev_tokens(step, prev_tokens)
        if self.capture:
            self.graphs[tokens].replay()
        else:
            self._forward(tokens)
        rows = self.buffers.logits_indices(len(step.logits_indices))
        return self.model.compute_logits(self.hidden.index_select(0, rows))


class GraphRun(NamedTuple):
    """Which graph runs a step: a family and its bucket."""

    graphs: DecodeGraphs  # a DecodeGraphs or a PrefillGraphs
    size: int  # the bucket: sequences (decode) or tokens (prefill)


class StepGraphs:
    """Both families over one set of step buffers, and the one place that picks a step's graph."""

    def __init__(self, decode: DecodeGraphs, prefill: PrefillGraphs) -> None:
        self.decode = decode
        self.prefill = prefill

    def pick(self, step: StepInput) -> GraphRun | None:
        """The smallest decode graph for a step of one token a sequence, else the smallest prefill
        graph that holds the step; None: no graph holds it (it runs eagerly)."""
        num_seqs, num_tokens = len(step.seq_lens), len(step.input_ids)
        if len(step.logits_indices) > num_seqs:
            return None  # prompt positions scored too (prompt logprobs): more rows than a graph holds
        if num_tokens == num_seqs:
            rows = self.decode.bucket(num_seqs)
            if rows is not None:
                return GraphRun(self.decode, rows)
        tokens = self.prefill.bucket(num_tokens)
        if tokens is not None and num_seqs <= self.prefill.max_num_seqs and self.prefill.buffers.fits(step):
            return GraphRun(self.prefill, tokens)
        return None
