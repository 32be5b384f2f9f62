"""Greedy decode windows (``--num-scheduler-steps N``): one scheduling round, N decode steps.

The device runs the steps back to back, each fed the previous one's argmax on the device
(``ModelRunner.decode_greedy``), while the host appends, detokenizes and checks the tokens
already out. A round qualifies when every sequence decodes plainly greedily; the engine's
ordinary step serves every other round.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.model_executor.step_input import build_step_input, window_steps

if TYPE_CHECKING:
    from pagefleet.worker.core.scheduler import SchedulerOutput
    from pagefleet.worker.engine.llm_engine import LLMEngine


def _greedy_only(seq: Sequence) -> bool:
    """Whether ``seq``'s next tokens are plain argmaxes of its logits (what a greedy window runs
    on the device): greedy, and nothing the sampler does on the host."""
    p = seq.params
    return (p.greedy and p.logprobs is None and seq.grammar is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and seq.num_output_tokens >= p.min_tokens)


def run_greedy_window(engine: LLMEngine, out: SchedulerOutput, started: float) -> set[str] | None:
    """Several decode steps of ``out``'s sequences in one go (``num_scheduler_steps``), the
    device feeding each step the previous one's greedy tokens while the host checks those
    already out; the request ids it stepped, or None (nothing run) where the round does not
    qualify: a prompt in the step, a sequence sampling on the host (not greedy, logprobs,
    penalties, a grammar, min_tokens to go), no room for the window's KV, or a runner without
    CUDA graphs' static buffers."""
    seqs = [item.seq for item in out.scheduled]
    window = engine.args.num_scheduler_steps
    if (out.preempted or not all(item.num_new_tokens == 1 and item.sample for item in out.scheduled)
            or any(s.num_tokens + window > engine.model_config.max_model_len or not _greedy_only(s)
                   for s in seqs)):
        return None
    # Room for the window's tokens now (a full pool: step by step instead). The first
    # token's slot was allocated by the schedule; blocks are published only over known tokens.
    if not all(engine.kv.allocate(s, window) for s in seqs):
        return None
    bs = engine.args.block_size
    steps = window_steps(build_step_input(out, bs, engine.kv.block_ids), engine.args.num_scheduler_steps, bs)
    runs = engine.executor.decode_greedy(steps) if hasattr(engine.executor, "decode_greedy") else None
    if runs is None:
        return None
    try:
        for tokens in runs:
            for seq, token in zip(seqs, tokens, strict=True):
                if seq.is_finished:
                    continue  # stopped earlier in the window: the rest of its tokens are dropped
                seq.num_computed_tokens += 1
                seq.append_token(token)
                engine.postprocess(seq)
            engine.kv.commit_step()
    except BaseException:
        engine.kv.unpublish_step()
        raise
    engine.num_steps += window
    took = (time.monotonic() - started) / window
    engine.step_time_s = took if not engine.step_time_s else 0.8 * engine.step_time_s + 0.2 * took
    return {seq.request_id for seq in seqs}
