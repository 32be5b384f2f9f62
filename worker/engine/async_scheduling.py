"""Async scheduling (``--async-scheduling``, vLLM's flag): the next decode step launched while the
device runs this one.

Without it the device waits, between two steps, for the host to bring the sampled tokens over,
append them, check the stops and schedule and build the next step. Here, once a step is
launched and its sampling queued, the step after it is built and launched at once: one more
token of each sequence the step samples, its input ids read on the device from the sampled
tokens (``ModelRunner.execute``'s ``prev_tokens``). The host then does its bookkeeping of the
first step while the device computes the second. Its positions, slots and lengths are known
without the tokens: each sequence's next token sits at its current length.

Sampling the launched step waits for the next engine step, after this step's tokens are
appended: penalties, grammars, min_tokens and seeded draws see every token before it, as
without async scheduling. A sequence that this step ends (EOS, a stop id; a stop string one
step later, as async output processing finds it) has computed one token for nothing, which is
dropped. One that length ends is left out of the launch, as is everything when a sequence still
has prompt to compute, when requests wait to be admitted (the scheduler's next round takes
them), or when the pool lacks a block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagefleet.worker.core.scheduler import ScheduledSeq, SchedulerOutput
from pagefleet.worker.model_executor.model_runner import StepInput

if TYPE_CHECKING:
    from pagefleet.worker.engine.llm_engine import LLMEngine
    from pagefleet.worker.model_executor.sampler import Drawn


def launch_next(engine: LLMEngine, out: SchedulerOutput, drawn: Drawn) -> tuple[SchedulerOutput, object] | None:
    """Launch the step after ``out`` (launched, its sampling queued as ``drawn``): its
    scheduler output and what the executor returned for it, or None where nothing was launched
    (module docstring)."""
    if engine.scheduler.waiting or not all(item.sample for item in out.scheduled):
        return None
    max_len = engine.model_config.max_model_len
    rows: list[int] = []
    items: list[ScheduledSeq] = []
    for row, item in enumerate(out.scheduled):  # every item samples: rows are the drawn tokens' rows
        seq = item.seq
        if seq.is_finished or seq.num_tokens + 1 >= max_len or (
                seq.params.max_tokens is not None and seq.num_output_tokens + 1 >= seq.params.max_tokens):
            continue  # ended already, or the token being sampled ends it by length
        # Room for this step's tokens (allocated) and the next one.
        if not engine.kv.allocate(seq, item.num_new_tokens + 1):
            return None
        rows.append(row)
        items.append(ScheduledSeq(seq, 1, True))
    if not items:
        return None
    bs = engine.args.block_size
    positions = [item.seq.num_tokens for item in items]  # where the token being sampled goes
    tables = [engine.kv.block_ids(item.seq) for item in items]
    n = len(items)
    step = StepInput(input_ids=rows, positions=positions,
                     slot_mapping=[t[p // bs] * bs + p % bs for t, p in zip(tables, positions)],
                     block_tables=tables, query_start_loc=list(range(n + 1)), seq_lens=[p + 1 for p in positions],
                     logits_indices=list(range(n)))
    try:
        forward = engine.executor.execute(step, drawn.tokens)
    except BaseException:
        engine.kv.unpublish_step()
        raise
    return SchedulerOutput(items), forward
