"""What a worker replica tells Ray Serve's autoscaler, and what the policy makes of it: every
request in the replica, whether it came through Serve or on the delta channel's connection
(Serve counts only the former), and the options that turn it on."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from pagefleet.cluster.config import ServeOptions
from pagefleet.router.worker_client.delta_mux import ChannelMux
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.replica.autoscaling import (
    KV_POLICY_FUNCTION,
    KV_TOTAL_METRIC,
    KV_USED_METRIC,
    LOAD_METRIC,
    POLICY_FUNCTION,
    kv_room_policy,
    requests_in_engines_policy,
)
from pagefleet.worker.replica.deployment import WorkerReplica, worker_deployment_options
from pagefleet.worker.replica.wire import Placed, WorkerRequest
from pagefleet.worker.sampling_params import SamplingParams

from channel_fakes import Call, SteppedEngine, settle, until


def _request(request_id: str, max_tokens: int) -> WorkerRequest:
    return WorkerRequest(request_id, [1, 2], SamplingParams(max_tokens=max_tokens), ranking=["local"],
                         channel="c1")


async def _connected(replica: WorkerReplica) -> ChannelMux:
    """A mux whose channel to the replica is an open connection (as test_sent_on_channel's)."""
    mux = ChannelMux(lambda request: Call(replica.channel(request)), channel_id="c1")
    mux.register("earlier")
    mux.placed("earlier", "local")
    await until(lambda: "local" in mux._connections and mux._connections["local"].open)
    mux.release("earlier")
    return mux


async def _close(replica: WorkerReplica, mux: ChannelMux) -> None:
    replica._channel_server.close()
    for connection in list(mux._connections.values()):
        connection._transport.close()
    for task in list(mux._readers.values()):
        task.cancel()
    await settle()


def _report(requests: float) -> dict[str, float]:
    """What the replica reports with ``requests``: SteppedEngine's stats say 10 of 100 blocks held."""
    return {LOAD_METRIC: requests, KV_USED_METRIC: 10.0, KV_TOTAL_METRIC: 100.0}


def test_the_replica_reports_requests_on_the_connection_through_serve_and_waiting_for_a_seat():
    async def run():
        replica = WorkerReplica(EngineArgs(), engine_factory=SteppedEngine, channel_host="127.0.0.1")
        replica.seats.limit = 3
        assert await replica.record_autoscaling_stats() == _report(0.0)
        mux = await _connected(replica)
        for rid in ("a", "b"):  # on the connection: Serve never sees them
            mux.register(rid)
            assert mux.send(_request(rid, 1), "local")
        await until(lambda: replica.engine.started == ["a", "b"])
        served = replica.generate(WorkerRequest("c", [1, 2], SamplingParams(max_tokens=1)))  # through Serve
        first = asyncio.ensure_future(served.__anext__())
        await until(lambda: replica.engine.started == ["a", "b", "c"])
        leaving = asyncio.ensure_future(replica.generate(_request("d", 1)).__anext__())  # in line for a seat
        waiting_call = replica.generate(_request("e", 1))
        waiting = asyncio.ensure_future(waiting_call.__anext__())
        await until(lambda: len(replica.seats.waiters) == 2)
        assert await replica.record_autoscaling_stats() == _report(5.0)
        leaving.cancel()  # its client went away while it waited
        await settle()
        assert await replica.record_autoscaling_stats() == _report(4.0)
        replica.engine.steps[0].set()  # a, b and c finish: e takes a seat and finishes too
        assert (await asyncio.wait_for(first, 2.0)).sequences[0].token_ids == [0]
        await served.aclose()
        assert await asyncio.wait_for(waiting, 2.0) == Placed("local")
        await waiting_call.aclose()
        await until(lambda: replica.seats.taken == 0)
        assert await replica.record_autoscaling_stats() == _report(0.0)
        assert replica.engine.started == ["a", "b", "c", "e"]
        await _close(replica, mux)

    asyncio.run(run())


def _context(config: dict, reported: dict[str, float], running: list[str], queued: float = 0.0,
             handle_count: float = 0.0, kv: dict[str, tuple[float, float]] | None = None) -> AutoscalingContext:
    """Serve's context as the controller gives it: each metric by replica (``kv``: (used, total))."""
    metrics = {LOAD_METRIC: reported}
    if kv is not None:
        metrics |= {KV_USED_METRIC: {r: used for r, (used, _) in kv.items()},
                    KV_TOTAL_METRIC: {r: total for r, (_, total) in kv.items()}}
    return AutoscalingContext(deployment_id=None, deployment_name="PagefleetWorker", app_name="pagefleet",
                              current_num_replicas=len(running), target_num_replicas=len(running),
                              running_replicas=running, total_num_requests=handle_count,
                              total_queued_requests=queued, aggregated_metrics=metrics,
                              raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
                              policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
                              current_time=0.0, config=AutoscalingConfig(**config))


def test_the_policy_wants_the_reported_requests_over_the_target():
    config = ServeOptions.from_dict({"workers": "1:8", "target_ongoing_requests": 4}).worker_autoscaling_config()
    # Serve's own count (handle_count) is one channel call per replica: it would keep one replica.
    ctx = _context(config, {"r1": 9.0, "r2": 7.0}, ["r1", "r2"], handle_count=2.0)
    assert requests_in_engines_policy(ctx) == (4.0, {})
    # requests queued in the ingress's handle for want of a replica count; a stopped replica's
    # last report does not, and a new replica that has not reported counts as idle
    ctx = _context(config, {"r1": 9.0, "r2": 7.0, "gone": 40.0}, ["r1", "r2", "new"], queued=4.0)
    assert requests_in_engines_policy(ctx) == (5.0, {})
    assert requests_in_engines_policy(_context(config, {}, ["r1"])) == (0.0, {})


def test_the_kv_policy_scales_up_before_the_blocks_run_short_and_down_only_with_room_to_spare():
    opts = ServeOptions.from_dict({"workers": "1:8", "target_ongoing_requests": 4, "autoscaling_policy": "kv"})
    config = opts.worker_autoscaling_config()
    assert config["policy"] == {"policy_function": KV_POLICY_FUNCTION}
    two = ["r1", "r2"]
    # few requests (1 replica by them) holding 170 of 2 x 100 blocks: 170 / (0.8 x 100) replicas
    ctx = _context(config, {"r1": 2.0, "r2": 2.0}, two, kv={"r1": (90.0, 100.0), "r2": (80.0, 100.0)})
    assert kv_room_policy(ctx) == (170 / 80, {})
    # more requests than blocks call for: the requests decide, as the requests policy would
    ctx = _context(config, {"r1": 14.0, "r2": 10.0}, two, kv={"r1": (30.0, 100.0), "r2": (30.0, 100.0)})
    assert kv_room_policy(ctx) == requests_in_engines_policy(ctx) == (6.0, {})
    # 100 blocks held: 1.25 replicas at the up share, 1.67 at the down share: it stays at 2
    ctx = _context(config, {"r1": 1.0, "r2": 1.0}, two, kv={"r1": (50.0, 100.0), "r2": (50.0, 100.0)})
    assert kv_room_policy(ctx) == (100 / 60, {})  # Serve rounds it up: 2
    # 50 blocks: one replica would hold half of its own, within the down share
    ctx = _context(config, {"r1": 1.0, "r2": 1.0}, two, kv={"r1": (25.0, 100.0), "r2": (25.0, 100.0)})
    assert kv_room_policy(ctx) == (50 / 60, {})
    # a new replica with no report yet counts as idle, its size the others': 90 blocks held of 200,
    # which one replica could hold only past the down share: it stays at 2
    ctx = _context(config, {"r1": 1.0}, ["r1", "new"], kv={"r1": (90.0, 100.0)})
    assert kv_room_policy(ctx) == (90 / 60, {})
    # nothing reported yet: by the requests
    assert kv_room_policy(_context(config, {"r1": 6.0}, ["r1"])) == (1.5, {})


def test_workers_min_max_gives_the_worker_deployment_an_autoscaling_config():
    opts = ServeOptions.from_dict({"workers": "1:4", "upscale_delay_s": 5, "downscale_delay_s": 60,
                                   "autoscaling_config": {"look_back_period_s": 20}})
    assert opts.serve.workers == "1:4" and opts.serve.worker_range == (1, 4) and opts.serve.autoscales
    config = opts.worker_autoscaling_config()
    assert opts.engine.max_num_seqs == 64  # the CPU default: the target is 3/4 of it
    assert config == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 48.0,
                      "upscale_delay_s": 5, "downscale_delay_s": 60, "look_back_period_s": 20,
                      "policy": {"policy_function": POLICY_FUNCTION}}
    assert AutoscalingConfig(**config).policy.policy_function == POLICY_FUNCTION  # Serve imports it
    options = worker_deployment_options(opts.engine, num_replicas=1, autoscaling_config=config)
    assert options["autoscaling_config"] == config and "num_replicas" not in options
    assert ServeOptions.from_dict({"workers": "1:4"}).logical_cpus_needed() == 4 * 1.0 + 0.5  # room for the most


@pytest.mark.parametrize("workers, fixed", [(3, 3), ("3", 3), ("2:2", 2)])
def test_a_fixed_worker_count_keeps_a_fixed_deployment(workers, fixed):
    opts = ServeOptions.from_dict({"workers": workers})
    assert opts.serve.workers == fixed and not opts.serve.autoscales
    assert opts.worker_autoscaling_config() is None
    options = worker_deployment_options(opts.engine, num_replicas=opts.serve.worker_range.min_replicas)
    assert options["num_replicas"] == fixed and "autoscaling_config" not in options


@pytest.mark.parametrize("args, message", [
    ({"workers": "0:3"}, "1 <= MIN <= MAX"),
    ({"workers": "4:2"}, "1 <= MIN <= MAX"),
    ({"workers": "1:x"}, "whole numbers"),
    ({"workers": 0}, "workers must be an integer >= 1, got 0"),
    ({"workers": True}, "N or MIN:MAX"),
    ({"workers": "1:4", "autoscaling_config": {"max_replicas": 9}}, r"may not set \['max_replicas'\]"),
    ({"target_ongoing_requests": 0}, "target_ongoing_requests must be > 0"),
    ({"downscale_delay_s": -1}, "must be >= 0"),
    ({"workers": "1:4", "autoscaling_policy": "queue"}, "autoscaling_policy must be one of requests, kv, got 'queue'"),
])
def test_bad_autoscaling_options_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        ServeOptions.from_dict(args).worker_autoscaling_config()
