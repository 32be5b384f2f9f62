"""Async scheduling (``--async-scheduling``, vLLM's flag): the next decode step launched while the
device runs this one.

Without it the device waits, between two steps, for the host to bring the sampled tokens over,
append them, check the stops and schedule and build the next step. Here, once a step is
launched and its sampling queued, the step after it is built and launched at once: one more
token of each sequence the step samples, its input ids read on the device from the sampled
tokens (``StepInput.prev_token_rows``). The host then does its bookkeeping of the
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

from pagefleet.worker.core.scheduler import SchedulerOutput
from pagefleet.worker.model_executor.step_input import build_step_input

if TYPE_CHECKING:
    from pagefleet.worker.engine.llm_engine import LLMEngine
    from pagefleet.worker.model_executor.sampler import Drawn


def launch_next(engine: LLMEngine, out: SchedulerOutput, drawn: Drawn) -> tuple[SchedulerOutput, object] | None:
    """Launch the step after ``out`` (launched and counted as computed, its sampling queued as
    ``drawn``), as ``Scheduler.schedule_ahead`` schedules it: its scheduler output and what the
    executor returned for it, or None where nothing was launched (module docstring)."""
    ahead = engine.scheduler.schedule_ahead(out, engine.model_config.max_model_len)
    if ahead is None:
        return None
    step = build_step_input(ahead, engine.args.block_size, engine.kv.block_ids)
    try:
        forward = engine.executor.execute(step, drawn.tokens)
    except BaseException:
        engine.kv.unpublish_step()
        raise
    return ahead, forward
