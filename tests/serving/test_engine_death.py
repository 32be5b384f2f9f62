"""A worker replica whose engine loop died leaves routing at once: its open streams fail with
``EngineDeadError``, it drops itself from the global scheduler's view (every ingress's copy
follows), then its process exits, so that no router sends it another request while Serve's health
check has yet to notice and Serve starts another replica. One that Serve stopped (a scale-down)
leaves the view the same way. The engine, the replica and the global scheduler actor are real;
the process exit is the test's stand-in."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.errors import EngineDeadError
from pagefleet.worker.replica.deployment import WorkerReplica
from pagefleet.worker.replica.wire import WorkerRequest
from pagefleet.worker.sampling_params import SamplingParams


def _request(request_id: str, max_tokens: int) -> WorkerRequest:
    return WorkerRequest(request_id, [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                  ignore_eos=True))


def test_a_replica_whose_engine_died_leaves_the_view_and_then_exits(ray_cluster, tiny_checkpoint):
    import ray

    from pagefleet.router.global_scheduler.actor import start_scheduler, stop_scheduler

    stop_scheduler()
    scheduler = start_scheduler()
    exits: list[tuple[object, float]] = []  # (the worker's view in the scheduler, when) at each exit
    exited = threading.Event()

    def exit_process() -> None:
        exits.append((ray.get(scheduler.worker_view.remote("local")), time.monotonic()))
        exited.set()

    args = EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32", device="cpu",
                      kv_cache_bytes=4 << 20, max_model_len=256)
    replica = WorkerReplica(args, kv_scheduler=scheduler, channel_host="127.0.0.1", exit_process=exit_process)

    async def run() -> float:
        first = [d async for d in replica.generate(_request("first", 4))]
        assert first[-1].finished and sum(len(d.sequences[0].token_ids) for d in first) == 4
        deadline = time.monotonic() + 30
        while await scheduler.worker_view.remote("local") is None:  # published into the view
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        steps = 0
        step = replica.engine.engine.step

        def step_then_fail():
            nonlocal steps
            steps += 1
            if steps == 3:
                raise RuntimeError("a step failed")
            return step()

        replica.engine.engine.step = step_then_fail
        got = []
        with pytest.raises(EngineDeadError, match="a step failed"):
            async for delta in replica.generate(_request("second", 50)):
                got.append(delta)
        assert [len(d.sequences[0].token_ids) for d in got] == [1, 1]  # the two steps before the failure
        return time.monotonic()

    try:
        failed_at = asyncio.run(run())
        assert exited.wait(15)
        assert len(exits) == 1
        view_at_exit, exited_at = exits[0]
        assert view_at_exit is None  # dropped from the view before the process went
        assert exited_at >= failed_at
        with pytest.raises(EngineDeadError):
            replica.engine.check_health()
    finally:
        replica._channel_server.close()
        replica.engine.shutdown()
        stop_scheduler()


def test_a_replica_serve_stopped_leaves_the_view_at_once_and_publishes_nothing_after(ray_cluster, tiny_checkpoint):
    """Serve calls ``__del__`` once its graceful shutdown drained the replica (a scale-down): the
    replica drops itself from the view then, not after the scheduler's liveness timeout, and its
    publisher sends nothing that would put it back."""
    import ray

    from pagefleet.router.global_scheduler.actor import start_scheduler, stop_scheduler

    stop_scheduler()
    scheduler = start_scheduler()
    args = EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32", device="cpu",
                      kv_cache_bytes=4 << 20, max_model_len=256)
    replica = WorkerReplica(args, kv_scheduler=scheduler, channel_host="127.0.0.1")

    async def run() -> None:
        first = [d async for d in replica.generate(_request("first", 4))]
        assert first[-1].finished
        deadline = time.monotonic() + 30
        while await scheduler.worker_view.remote("local") is None:  # published into the view
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        snapshot = await replica.kv_snapshot()
        replica.__del__()
        assert await scheduler.worker_ids.remote() == set()
        await replica._link.publish_snapshot(snapshot)  # what its publisher would send next: not sent
        assert await scheduler.worker_ids.remote() == set()

    try:
        asyncio.run(run())
        assert ray.get(scheduler.worker_view.remote("local")) is None
        assert ray.get(scheduler.counters.remote()).workers_dropped == 1
    finally:
        stop_scheduler()
