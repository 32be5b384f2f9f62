"""A worker replica's engine and Serve calls, scripted, for the delta channel's tests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pagefleet.router.metrics import RouterMetrics
from pagefleet.worker.metrics.stats import EngineStats
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta


class ReasonMetrics(RouterMetrics):
    """The ingress's metrics, recording nothing in Ray: the reason of each ``worker_resends`` and
    each ``failovers``."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = False
        self.resends: list[str] = []
        self.failovers: list[str] = []

    def inc(self, key: str, value: float = 1.0, **tags: str) -> None:
        super().inc(key, value, **tags)  # checks the key against the table
        if key == "worker_resends":
            self.resends.append(tags["reason"])
        elif key == "failovers":
            self.failovers.append(tags["reason"])


def delta(request_id: str, token: int, finished: bool = False) -> RequestOutputDelta:
    return RequestOutputDelta(request_id, [CompletionOutput(0, f"t{token}", [token], None,
                                                            "length" if finished else None)], 1, 0, finished)


class IdleEngineParts:
    """What a worker replica asks of its engine besides ``generate``, answered as an idle engine would."""

    def stats(self):
        return EngineStats(100, 90, 1, 2, 0, 0, 0, 5, 10, 20)

    def check_health(self):
        pass

    def shutdown(self):
        pass


class SteppedEngine(IdleEngineParts):
    """Every running request gets its next delta when the test sets that step's event (all but
    the last to ``forward`` when the replica gives one)."""

    def __init__(self, args):
        self.model_config = SimpleNamespace(served_model_name="m", max_model_len=64)
        self.steps = [asyncio.Event() for _ in range(8)]
        self.started: list[str] = []
        self.closed: list[str] = []

    async def generate(self, request_id, prompt_token_ids, params, extra_keys=(), block_hashes=None, span=None,
                       resume=None, forward=None, client="", priority=0, lora_name=None, lora_path=None):
        if request_id in self.started and request_id not in self.closed:  # as AsyncLLMEngine refuses it
            raise ValueError(f"request id {request_id!r} is already running")
        self.started.append(request_id)
        try:
            for step in range(params.max_tokens):
                await self.steps[step].wait()
                last = step == params.max_tokens - 1
                if forward is not None and not last:  # as AsyncLLMEngine hands them on
                    forward(delta(request_id, step))
                else:
                    yield delta(request_id, step, last)
        finally:
            self.closed.append(request_id)


class ReplicaHandle:
    """The worker deployment's Serve handle over one real replica: Serve calls become direct calls.
    ``generate_calls``: (request id, ranking) of each request that went through Serve."""

    app_name = "app"
    deployment_name = "PagefleetWorker"

    def __init__(self, replica) -> None:
        self.replica = replica
        self.generate_calls: list[tuple[str, list[str] | None]] = []

    def options(self, method_name, stream=False):
        return _ReplicaMethod(self, method_name)


class _ReplicaMethod:
    def __init__(self, handle: ReplicaHandle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, arg):
        if self.name == "load_lora":
            return self.handle.replica.load_lora(arg)
        if self.name == "channel":
            return Call(self.handle.replica.channel(arg))
        self.handle.generate_calls.append((arg.request_id, arg.ranking))
        return Call(self.handle.replica.generate(arg))


class Call:
    """A replica's ``channel`` call as the mux sees a Serve stream of it."""

    def __init__(self, gen):
        self._gen = gen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._gen.__anext__()

    def cancel(self):
        asyncio.ensure_future(self._gen.aclose())


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")
