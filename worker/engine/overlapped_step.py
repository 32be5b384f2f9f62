"""The overlapped step: async output processing (``--async-output-proc``), alone or with async
scheduling (``--async-scheduling``, vLLM's flag).

Async output processing: EOS, stop ids and lengths end sequences as soon as their tokens are
appended, before the next schedule; the rest of a step's outputs (detokenizing, stop strings,
the deltas) waits for the next step's device time, if a next step there is. A stop string is
thus found one step late, and the token its sequence computed meanwhile is dropped.

Async scheduling: without it the device waits, between two steps, for the host to bring the
sampled tokens over, append them, check the stops and schedule and build the next step. Here,
once a step is launched and its sampling queued, the step after it is scheduled
(``Scheduler.schedule_ahead``) and launched at once: one more token of each sequence the step
samples, read on the device from the sampled tokens (``StepInput.prev_token_rows``), and the
requests waiting for a seat as the scheduler would admit them. The host then does its
bookkeeping of the first step while the device computes the second. Its positions, slots and
lengths are known without the tokens: each sequence's next token sits at its current length.

Sampling the launched step waits for the next turn, after this step's tokens are appended:
penalties, grammars, min_tokens and seeded draws see every token before it, as without async
scheduling. A sequence this step ends has computed one token for nothing, which is dropped.
"""

from __future__ import annotations

import time

from pagefleet.worker.core.scheduler import SchedulerOutput
from pagefleet.worker.engine.output_processor import DeferredOutputs
from pagefleet.worker.engine.step_loop import InFlight, StepParts, stepped_requests
from pagefleet.worker.outputs import RequestOutputDelta


class OverlappedStep:
    def __init__(self, parts: StepParts, async_scheduling: bool) -> None:
        self.parts = parts
        self.async_scheduling = async_scheduling

    def __call__(self, in_flight: InFlight | None) -> tuple[list[RequestOutputDelta], InFlight | None]:
        """Run the step launched ahead, or schedule and launch one; finish the previous step's
        outputs while it runs."""
        p = self.parts
        ahead, deferred = in_flight if in_flight is not None else (None, None)
        arrived = p.outputs.take_finished_on_arrival()
        started = time.monotonic()
        if ahead is not None:
            out, forward = ahead
        else:
            out = p.scheduler.schedule()
            if not out.scheduled:
                return p.outputs.finish_deferred(deferred) + p.outputs.collect(arrived), None
            forward = p.launch(out)
        # Asynchronous devices (CUDA, a simulated GPU) are computing now: the host finishes the
        # previous step's outputs meanwhile.
        earlier = p.outputs.hand_early(p.outputs.finish_deferred(deferred))
        return self.run(out, forward, started, arrived, earlier)

    def run(self, out: SchedulerOutput, forward: object, started: float, arrived: set[str],
            earlier: list[RequestOutputDelta]) -> tuple[list[RequestOutputDelta], InFlight | None]:
        """The rest of a launched step: sample it (launching the next, under async scheduling),
        end what ends by its token alone, and defer the rest of its outputs."""
        p = self.parts
        got, ahead = p.sample(out, forward, self.async_scheduling)
        p.stats.record(1, time.monotonic() - started)
        stepped = stepped_requests(out, arrived)
        waiting = [seq for seq in got if not p.outputs.ends_now(seq)]
        if not (p.scheduler.running or p.scheduler.waiting):
            # Every sequence has ended: a step launched ahead computes only dropped tokens.
            for seq in waiting:
                p.outputs.postprocess(seq)
            return earlier + p.outputs.collect(stepped), None
        return earlier, InFlight(ahead, DeferredOutputs(waiting, stepped))
