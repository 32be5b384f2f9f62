"""One forward pass as plain data (``StepInput``), and the builders every step comes from.

A step is built from a scheduler output (``build_step_input``), including the step launched
ahead under async scheduling, whose first sequences take the tokens the previous step is still
sampling on the device (``prev_token_rows``); from a greedy window's first step
(``window_steps``); or as the fixed shapes of a profile run and of graph capture. The other
tensor-parallel ranks decode it from rank 0's broadcast (``parallel.step_wire``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pagefleet.worker.core.scheduler import SchedulerOutput
    from pagefleet.worker.core.sequence import Sequence


@dataclass(slots=True)
class StepInput:
    """One forward pass as plain data (what rank 0 sends every tensor-parallel rank)."""

    input_ids: list[int]           # [T]
    positions: list[int]           # [T]
    slot_mapping: list[int]        # [T]
    block_tables: list[list[int]]  # B rows, ragged
    query_start_loc: list[int]     # [B + 1]
    seq_lens: list[int]            # [B]
    logits_indices: list[int]      # rows of T whose next token is sampled
    # Token i of the step, for i < len(prev_token_rows), is the token the previous step samples in
    # row prev_token_rows[i], read on the device (ModelRunner.execute's prev_tokens); its input id
    # here is a placeholder, never read (async scheduling).
    prev_token_rows: list[int] = field(default_factory=list)
    # Each sequence row's LoRA adapter (its lora_int_id; None: the base model), or empty where no
    # row of the step runs one.
    lora_ids: list[int | None] = field(default_factory=list)


def build_step_input(out: SchedulerOutput, block_size: int,
                     block_ids_of: Callable[[Sequence], list[int]]) -> StepInput:
    """Flatten a scheduler output into a StepInput; its sampled rows are ``out.sampled_seqs()``."""
    k = len(out.prev_token_rows)
    step = _prev_token_part(out, block_size, block_ids_of) if k else StepInput([], [], [], [], [0], [], [])
    input_ids, positions, slots, tables = step.input_ids, step.positions, step.slot_mapping, step.block_tables
    starts, seq_lens, logits_indices = step.query_start_loc, step.seq_lens, step.logits_indices
    prompt_rows: list[int] = []  # after the sampling rows: prompt_logprob_spans' positions
    for item in out.scheduled[k:] if k else out.scheduled:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        end = start + n
        span = _prompt_span(seq, n)
        if span is not None:
            prompt_rows.extend(range(starts[-1] + span[0] - start, starts[-1] + span[1] - start))
        blocks = block_ids_of(seq)
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        tables.append(blocks)
        starts.append(starts[-1] + n)
        seq_lens.append(end)
        if item.sample:
            logits_indices.append(starts[-1] - 1)
    logits_indices.extend(prompt_rows)
    step.lora_ids = lora_ids_of(out)
    return step


def lora_ids_of(out: SchedulerOutput) -> list[int | None]:
    """Each scheduled sequence's adapter id, in row order; [] where none runs one."""
    ids = [None if item.seq.lora_request is None else item.seq.lora_request.lora_int_id for item in out.scheduled]
    return ids if any(i is not None for i in ids) else []


def prompt_logprob_spans(out: SchedulerOutput) -> list[tuple[Sequence, int, int]]:
    """(sequence, first, stop): the positions of ``out`` (before it is counted as computed) whose
    logits score the next prompt token, for sequences asking for prompt logprobs; their logits
    rows follow the sampling rows, in this order (``build_step_input``)."""
    spans = []
    for item in out.scheduled:
        span = _prompt_span(item.seq, item.num_new_tokens)
        if span is not None:
            spans.append((item.seq, *span))
    return spans


def _prompt_span(seq: Sequence, num_new_tokens: int) -> tuple[int, int] | None:
    if seq.prompt_logprobs is None:
        return None
    first = seq.num_computed_tokens
    stop = min(first + num_new_tokens, seq.num_prompt_tokens - 1)  # the last prompt position scores an output
    return (first, stop) if first < stop else None


def _prev_token_part(out: SchedulerOutput, block_size: int,
                     block_ids_of: Callable[[Sequence], list[int]]) -> StepInput:
    """The step's first ``len(out.prev_token_rows)`` sequences: each computes, and samples after,
    the token the previous step is sampling for it, which sits at its computed length (every
    token the host has counts as computed) and whose id the device reads."""
    k = len(out.prev_token_rows)
    seqs = [item.seq for item in out.scheduled[:k]]
    positions = [seq.num_computed_tokens for seq in seqs]
    tables = [block_ids_of(seq) for seq in seqs]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    return StepInput([0] * k, positions, slots, tables, list(range(k + 1)), [p + 1 for p in positions],
                     list(range(k)), out.prev_token_rows)


def window_steps(first: StepInput, window: int, block_size: int) -> list[StepInput]:
    """A greedy window's steps: ``first`` (a decode step) and the ``window - 1`` after it over
    the same sequences, one position further each; their input ids are the previous step's
    argmax on the device, so these hold placeholders, never read."""
    steps = [first]
    tables = first.block_tables
    for j in range(1, window):
        positions = [p + j for p in first.positions]
        slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
        steps.append(StepInput([0] * len(positions), positions, slots, tables, first.query_start_loc,
                               [n + j for n in first.seq_lens], first.logits_indices, lora_ids=first.lora_ids))
    return steps


def padding_step() -> StepInput:
    """A step of nothing: ``StepBuffers.fill`` pads it to a graph's whole shape for capture."""
    return StepInput([], [], [], [], [0], [], [])


def profile_step(num_tokens: int, block_size: int, decode: bool = False) -> StepInput:
    """The largest step a profile run measures: one sequence of ``num_tokens`` (``decode``:
    ``num_tokens`` sequences of one token each, every row sampled) over blocks 0.. of a scratch
    cache."""
    tokens = list(range(num_tokens))
    if decode:
        return StepInput(tokens, [0] * num_tokens, tokens, [[i // block_size] for i in tokens],
                         list(range(num_tokens + 1)), [1] * num_tokens, tokens)
    nblocks = -(-num_tokens // block_size)
    return StepInput(tokens, tokens, tokens, [list(range(nblocks))], [0, num_tokens], [num_tokens], [num_tokens - 1])
