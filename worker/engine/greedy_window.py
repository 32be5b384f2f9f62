"""Greedy decode windows (``--num-scheduler-steps N``): one scheduling round, N decode steps.

The device runs the steps back to back, each fed the previous one's argmax on the device
(``ModelRunner.decode_greedy``), while the host appends, detokenizes and checks the tokens
already out. A round qualifies when every sequence decodes plainly greedily; the plain or
overlapped step serves every other round.
"""

from __future__ import annotations

import time

from pagefleet.worker.core.scheduler import SchedulerOutput
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.engine.overlapped_step import OverlappedStep
from pagefleet.worker.engine.step_loop import InFlight, PlainStep, StepParts
from pagefleet.worker.model_executor.step_input import build_step_input, window_steps
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.sample.logits_processors import wants_processing


def _greedy_only(seq: Sequence) -> bool:
    """Whether ``seq``'s next tokens are plain argmaxes of its logits (what a greedy window runs
    on the device): greedy, and nothing the sampler does on the host."""
    p = seq.params
    return (p.greedy and p.logprobs is None and seq.grammar is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and seq.num_output_tokens >= p.min_tokens
            and not wants_processing(seq))


class WindowedStep:
    def __init__(self, parts: StepParts, window: int, base: PlainStep | OverlappedStep) -> None:
        self.parts = parts
        self.window = window
        self.base = base  # runs the rounds that do not qualify

    def __call__(self, in_flight: InFlight | None) -> tuple[list[RequestOutputDelta], InFlight | None]:
        p = self.parts
        deferred = None if in_flight is None else in_flight.deferred  # nothing is launched ahead here
        arrived = p.outputs.take_finished_on_arrival()
        started = time.monotonic()
        out = p.scheduler.schedule()
        if not out.scheduled:
            return p.outputs.finish_deferred(deferred) + p.outputs.collect(arrived), None
        earlier = p.outputs.hand_early(p.outputs.finish_deferred(deferred))
        done = self.run_window(out)
        if done is not None:
            p.stats.record(self.window, time.monotonic() - started)
            return earlier + p.outputs.collect(done | arrived), None
        return self.base.run(out, p.launch(out), started, arrived, earlier)

    def run_window(self, out: SchedulerOutput) -> set[str] | None:
        """Several decode steps of ``out``'s sequences in one go, the device feeding each step
        the previous one's greedy tokens while the host checks those already out; the request
        ids it stepped, or None (nothing run) where the round does not qualify: a prompt in the
        step, a sequence sampling on the host (not greedy, logprobs, penalties, a grammar,
        min_tokens to go), no room for the window's KV, or a runner without CUDA graphs' static
        buffers."""
        p, window = self.parts, self.window
        seqs = [item.seq for item in out.scheduled]
        if (out.preempted or not all(item.num_new_tokens == 1 and item.sample for item in out.scheduled)
                or any(s.num_tokens + window > p.max_model_len or not _greedy_only(s) for s in seqs)):
            return None
        # Room for the window's tokens now (a full pool: step by step instead). The first
        # token's slot was allocated by the schedule; blocks are published only over known tokens.
        if not all(p.kv.allocate(s, window) for s in seqs):
            return None
        steps = window_steps(build_step_input(out, p.block_size, p.kv.block_ids), window, p.block_size)
        runs = p.executor.decode_greedy(steps) if hasattr(p.executor, "decode_greedy") else None
        if runs is None:
            return None
        try:
            for tokens in runs:
                for seq, token in zip(seqs, tokens, strict=True):
                    if seq.is_finished:
                        continue  # stopped earlier in the window: the rest of its tokens are dropped
                    seq.num_computed_tokens += 1
                    seq.append_token(token)
                    p.outputs.postprocess(seq)
                p.kv.commit_step()
        except BaseException:
            p.kv.unpublish_step()
            raise
        return {seq.request_id for seq in seqs}
