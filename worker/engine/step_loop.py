"""The engine's step loop: one step function, picked once at start, and the work in flight that
each turn of the loop hands the next.

Three step functions, one per way of running a step:

* ``PlainStep``: schedule, launch, sample, process the outputs, return them.
* ``OverlappedStep`` (``overlapped_step.py``): async output processing, alone or with async
  scheduling; a step's outputs are processed while the next step's device work runs, and the
  next decode step may be launched before this one's tokens reach the host.
* ``WindowedStep`` (``greedy_window.py``): ``--num-scheduler-steps``; a round whose sequences
  all decode greedily runs as one window of device steps, any other round as the plain or
  overlapped step does.

What one turn leaves the next is one value, ``InFlight``: the step launched ahead and the
outputs deferred. A step function takes it and returns the next (None: nothing in flight).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, NamedTuple

from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.scheduler import Scheduler, SchedulerOutput
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.engine.output_processor import DeferredOutputs, OutputProcessor
from pagefleet.worker.model_executor.step_input import build_step_input, prompt_logprob_spans
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.sample.prompt_logprobs import score_prompts

if TYPE_CHECKING:
    from pagefleet.worker.model_executor.simulated_sampler import SimulatedSampler
    from pagefleet.worker.parallel.executor import Executor
    from pagefleet.worker.sample.sampler import Drawn, Sampler


class LaunchedStep(NamedTuple):
    """A step on the device: its scheduler output and what the executor returned for it."""

    out: SchedulerOutput
    forward: object  # the sampling rows' logits, or the simulated GPU's queued step


class InFlight(NamedTuple):
    """What one turn of the step loop hands the next."""

    ahead: LaunchedStep | None = None  # launched before the last step's tokens reached the host
    deferred: DeferredOutputs | None = None  # the last step's outputs, processed during this step


StepFn = Callable[[InFlight | None], tuple[list[RequestOutputDelta], InFlight | None]]


class StepStats:
    """Steps run, and recent seconds per step that ran something (moving average; 0 until one
    ran): the KV events publish it, so admission control can tell when running sequences end."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.step_time_s = 0.0

    def record(self, num_steps: int, seconds: float) -> None:
        self.num_steps += num_steps
        took = seconds / num_steps
        self.step_time_s = took if not self.step_time_s else 0.8 * self.step_time_s + 0.2 * took


class StepParts:
    """What every step function is made of: the engine's parts, and the launch and sampling of
    a scheduled step."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, executor: Executor,
                 sampler: Sampler | SimulatedSampler, outputs: OutputProcessor, block_size: int,
                 max_model_len: int) -> None:
        self.scheduler, self.kv, self.executor, self.sampler = scheduler, kv, executor, sampler
        self.outputs = outputs
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.stats = StepStats()

    def launch(self, out: SchedulerOutput, drawn: Drawn | None = None) -> object:
        """Build ``out``'s step and queue it on the device. ``drawn``: the previous step's
        sampling, still on the device, whose tokens a step launched ahead reads."""
        step = build_step_input(out, self.block_size, self.kv.block_ids)
        try:
            return self.executor.execute(step) if drawn is None else self.executor.execute(step, drawn.tokens)
        except BaseException:
            self.kv.unpublish_step()  # blocks hashed for this step hold no valid KV
            raise

    def sample(self, out: SchedulerOutput, forward: object,
               launch_ahead: bool = False) -> tuple[list[Sequence], LaunchedStep | None]:
        """Count ``out`` as computed, sample it and append the tokens: the sequences that got one.
        ``launch_ahead``: launch the next step (``Scheduler.schedule_ahead``) once the sampling
        is queued and before its tokens reach the host; returned too (None: none launched)."""
        self.kv.commit_step()
        spans = prompt_logprob_spans(out)  # before the step counts as computed
        sampled_seqs = out.sampled_seqs()
        self.scheduler.advance(out)
        if spans:  # their logits rows follow the sampling rows
            score_prompts(forward[len(sampled_seqs):], spans)
            forward = forward[:len(sampled_seqs)]
        if not sampled_seqs:
            return self.scheduler.append_sampled(out, None), None
        drawn = self.sampler.draw(forward, sampled_seqs)
        ahead = None
        if launch_ahead:
            next_out = self.scheduler.schedule_ahead(out, self.max_model_len)
            ahead = None if next_out is None else LaunchedStep(next_out, self.launch(next_out, drawn))
        sampled = self.sampler.collect(drawn, sampled_seqs)
        return self.scheduler.append_sampled(out, sampled), ahead


def stepped_requests(out: SchedulerOutput, arrived: set[str]) -> set[str]:
    """The requests whose deltas a step of ``out`` makes: those it ran, and those reported
    because they arrived finished."""
    return {item.seq.request_id for item in out.scheduled} | arrived


class PlainStep:
    """Schedule, launch, sample, process the outputs: each step whole before the next."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    def __call__(self, in_flight: InFlight | None) -> tuple[list[RequestOutputDelta], InFlight | None]:
        p = self.parts
        arrived = p.outputs.take_finished_on_arrival()
        started = time.monotonic()
        out = p.scheduler.schedule()
        if not out.scheduled:
            return p.outputs.collect(arrived), None
        return self.run(out, p.launch(out), started, arrived, [])

    def run(self, out: SchedulerOutput, forward: object, started: float, arrived: set[str],
            earlier: list[RequestOutputDelta]) -> tuple[list[RequestOutputDelta], InFlight | None]:
        """The rest of a launched step: ``earlier``, deltas made before, go out first."""
        p = self.parts
        got, _ = p.sample(out, forward)
        p.stats.record(1, time.monotonic() - started)
        for seq in got:
            p.outputs.postprocess(seq)
        return earlier + p.outputs.collect(stepped_requests(out, arrived)), None

