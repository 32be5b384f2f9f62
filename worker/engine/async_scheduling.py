"""Async scheduling (``--async-scheduling``, vLLM's flag): the next decode step launched while the
device runs this one.

Without it the device waits, between two steps, for the host to bring the sampled tokens over,
append them, check the stops and schedule and build the next step. Here, once a step is
launched and its sampling queued, the step after it is built and launched at once: one more
token of each sequence the step samples, its input ids read on the device from the sampled
tokens (``ModelRunner.execute``'s ``prev_tokens``). The host then does its bookkeeping of the
first step while the device computes the second. Its positions, slots and lengths are known
without the tokens: each sequence's next token sits at its current length. Requests waiting
for a seat join that step as the scheduler would admit them (``Scheduler.admit``), their
prompts' ids known on the host.

Sampling the launched step waits for the next engine step, after this step's tokens are
appended: penalties, grammars, min_tokens and seeded draws see every token before it, as
without async scheduling. A sequence that this step ends (EOS, a stop id; a stop string one
step later, as async output processing finds it) has computed one token for nothing, which is
dropped. One that length ends is left out of the launch, and nothing is launched when a
sequence still has prompt to compute after this step or the pool lacks a block for a next
token: the scheduler's next round takes over, preempting if it must.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagefleet.worker.core.scheduler import ScheduledSeq, SchedulerOutput
from pagefleet.worker.model_executor.model_runner import StepInput, build_step_input

if TYPE_CHECKING:
    from pagefleet.worker.engine.llm_engine import LLMEngine
    from pagefleet.worker.sample.sampler import Drawn


def launch_next(engine: LLMEngine, out: SchedulerOutput, drawn: Drawn) -> tuple[SchedulerOutput, object] | None:
    """Launch the step after ``out`` (launched and counted as computed, its sampling queued as
    ``drawn``; a sequence's prompt done in ``out`` lets its parallel samples in): its
    scheduler output and what the executor returned for it, or None where nothing was launched
    (module docstring)."""
    if not all(item.sample for item in out.scheduled):
        return None
    max_len = engine.model_config.max_model_len
    rows: list[int] = []
    ahead = SchedulerOutput()
    for row, item in enumerate(out.scheduled):  # every item samples: rows are the drawn tokens' rows
        seq = item.seq
        if seq.is_finished or seq.num_tokens + 1 >= max_len or (
                seq.params.max_tokens is not None and seq.num_output_tokens + 1 >= seq.params.max_tokens):
            continue  # ended already, or the token being sampled ends it by length
        # Room for the next token (the launched step's tokens count as computed already).
        if not engine.kv.allocate(seq, 1):
            return None
        rows.append(row)
        ahead.scheduled.append(ScheduledSeq(seq, 1, True))
    n = len(rows)
    # Waiting requests join as the scheduler's round would admit them, with the tokens left.
    engine.scheduler.admit(ahead, engine.args.max_num_batched_tokens - n)
    if not ahead.scheduled:
        return None
    bs = engine.args.block_size
    positions = [item.seq.num_tokens for item in ahead.scheduled[:n]]  # where the tokens being sampled go
    tables = [engine.kv.block_ids(item.seq) for item in ahead.scheduled[:n]]
    new = build_step_input(SchedulerOutput(ahead.scheduled[n:]), bs, engine.kv.block_ids)
    step = StepInput(input_ids=[-1 - r for r in rows] + new.input_ids,
                     positions=positions + new.positions,
                     slot_mapping=[t[p // bs] * bs + p % bs for t, p in zip(tables, positions)] + new.slot_mapping,
                     block_tables=tables + new.block_tables,
                     query_start_loc=list(range(n)) + [n + q for q in new.query_start_loc],
                     seq_lens=[p + 1 for p in positions] + new.seq_lens,
                     logits_indices=list(range(n)) + [n + i for i in new.logits_indices])
    try:
        forward = engine.executor.execute(step, drawn.tokens)
    except BaseException:
        engine.kv.unpublish_step()
        raise
    return ahead, forward
