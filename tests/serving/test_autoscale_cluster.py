"""`workers: "1:4"` on a real local Ray cluster with simulated workers: a load ramp takes the worker
deployment from 1 replica to at least 3 and, once the load falls, back to 1 while requests still
run; no request fails, every stream ends whole with [DONE], and the global view then holds the
one worker left, equal to its pool. Serve's autoscaler sees the load only through what the replicas
report (most requests come on the delta channel's connection): this is that report at work.

The delays and windows are short so the ramp fits a CI run: Serve decides every 0.1 s on the
replicas' reports, pushed every 0.5 s over a 2 s look-back."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import pytest

from cluster_app import APP, assert_views_equal_pools, start_app

MODEL = "llama-3-8b"
TARGET = 2  # requests per replica: 8 clients call for all 4


def _running_workers() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["PagefleetWorker"]
    return status.replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def server(ray_cluster, serve_http_port, tmp_path_factory):
    from ray import serve

    from pagefleet.router.global_scheduler.actor import stop_scheduler
    from pagefleet.worker.simulated.checkpoint import simulated_checkpoint

    stop_scheduler()
    simulated_checkpoint(MODEL)
    yield start_app(ray_cluster, serve_http_port, MODEL, tmp_path_factory.mktemp("serve"), simulate="h200",
                    kv_cache_bytes=None, workers="1:4",
                    max_model_len=1024,  # a prompt and 256 tokens (cluster_app's 256 would refuse them all)
                    target_ongoing_requests=TARGET, upscale_delay_s=1.0,
                    downscale_delay_s=4.0, drain_timeout_s=15.0,
                    autoscaling_config={"look_back_period_s": 2.0, "metrics_interval_s": 0.5})
    serve.delete(APP)
    stop_scheduler()


async def _client(http: httpx.AsyncClient, base: str, i: int, stop: asyncio.Event, outcomes: list) -> None:
    """Requests one after another until ``stop``: streamed and not, each long enough to hold a seat.
    Each outcome is (status, its end): "data: [DONE]" for all 256 tokens, a streamed one's only
    after a usage chunk that says 256 and no error chunk before it (a cut stream shows here)."""
    n = 0
    while not stop.is_set():
        body = {"model": MODEL, "prompt": f"client {i} request {n}", "max_tokens": 256, "ignore_eos": True}
        if n % 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
            chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]] if r.status_code == 200 else []
            whole = (lines[-1:] == ["data: [DONE]"] and not any("error" in c for c in chunks)
                     and chunks[-1].get("usage", {}).get("completion_tokens") == 256)
            outcomes.append((r.status_code, "data: [DONE]" if whole else lines[-3:]))
        else:
            r = await http.post(f"{base}/v1/completions", json=body)
            done = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256
            outcomes.append((r.status_code, "data: [DONE]" if done else r.text[:200]))
        n += 1


async def _until(workers: Callable[[int], bool], timeout_s: float) -> int:
    """Polls the running workers until ``workers(count)``; returns the last count."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = await asyncio.to_thread(_running_workers)
        if workers(count) or time.monotonic() > deadline:
            return count
        await asyncio.sleep(0.5)


async def _ramp(base: str) -> tuple[list, int, int]:
    """One client, then eight until 3 workers run, then one until 1 does, then none: (outcomes,
    most workers seen, workers when the last stopped). Serve stops replicas while that one runs,
    so its requests meet the drain (or the failover) of the replicas it stops. One, not two: two
    clients at a target of 2 a replica sit on the boundary, where a request overlapping the next
    can hold a second replica."""
    outcomes: list = []
    async with httpx.AsyncClient(timeout=120) as http:
        stops = [asyncio.Event() for _ in range(8)]
        clients = [asyncio.ensure_future(_client(http, base, 0, stops[0], outcomes))]
        await asyncio.sleep(2)
        clients += [asyncio.ensure_future(_client(http, base, i, stops[i], outcomes)) for i in range(1, 8)]
        most = await _until(lambda n: n >= 3, 90)
        await asyncio.sleep(2)  # the new replicas take requests too
        most = max(most, await asyncio.to_thread(_running_workers))
        for stop in stops[1:]:
            stop.set()
        least = await _until(lambda n: n == 1, 60) if most >= 3 else most
        await asyncio.sleep(2)  # the one left takes them all
        stops[0].set()
        await asyncio.gather(*clients)
    return outcomes, most, least


def test_a_load_ramp_scales_the_workers_up_and_back_down_without_a_failed_request(server):
    import ray

    from pagefleet.router.global_scheduler.actor import get_scheduler

    assert _running_workers() == 1
    outcomes, most, least = asyncio.run(_ramp(server))
    # First: a refused request never reaches a worker, so it cannot scale one up either.
    bad = [o for o in outcomes if o != (200, "data: [DONE]")]
    assert outcomes and not bad, (len(bad), len(outcomes), bad[:5])
    assert most >= 3
    assert least == 1, f"{least} workers 60 s after the load fell to 1 request (target {TARGET} per replica)"
    assert _running_workers() == 1
    # The stopped workers left the global view (and each ingress's copy), the one left is in it as its pool is.
    scheduler = get_scheduler()
    (live,) = assert_views_equal_pools(scheduler, workers=1)
    deadline = time.monotonic() + 15
    while (ids := ray.get(scheduler.worker_ids.remote())) != {live}:
        assert time.monotonic() < deadline, f"the global view holds {sorted(ids)}, only {live} runs"
        time.sleep(0.5)
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
