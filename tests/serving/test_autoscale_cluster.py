"""`workers: "1:4"` on a real local Ray cluster with simulated workers: a load ramp takes the worker
deployment from 1 replica to at least 3 and, once the load stops, back to 1; no request fails and
every stream ends with [DONE]. Serve's autoscaler sees the load only through what the replicas
report (most requests come on the delta channel's connection): this is that report at work.

The delays and windows are short so the ramp fits a CI run: Serve decides every 0.1 s on the
replicas' reports, pushed every 0.5 s over a 2 s look-back."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cluster_app import APP, start_app

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
                    downscale_delay_s=4.0, drain_timeout_s=5.0,
                    autoscaling_config={"look_back_period_s": 2.0, "metrics_interval_s": 0.5})
    serve.delete(APP)
    stop_scheduler()


async def _client(http: httpx.AsyncClient, base: str, i: int, stop: asyncio.Event, outcomes: list) -> None:
    """Requests one after another until ``stop``: streamed and not, each long enough to hold a seat."""
    n = 0
    while not stop.is_set():
        body = {"model": MODEL, "prompt": f"client {i} request {n}", "max_tokens": 256, "ignore_eos": True}
        if n % 2:
            async with http.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
                lines = [line async for line in r.aiter_lines() if line]
                outcomes.append((r.status_code, lines[-1] if lines else None))
        else:
            r = await http.post(f"{base}/v1/completions", json=body)
            done = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256
            outcomes.append((r.status_code, "data: [DONE]" if done else r.text[:200]))
        n += 1


async def _ramp(base: str) -> tuple[list, int, float]:
    """One client, then eight until 3 workers run, then none: (outcomes, most workers seen, when
    the load stopped)."""
    outcomes: list = []
    most = 1
    async with httpx.AsyncClient(timeout=120) as http:
        stop = asyncio.Event()
        clients = [asyncio.ensure_future(_client(http, base, 0, stop, outcomes))]
        await asyncio.sleep(3)
        clients += [asyncio.ensure_future(_client(http, base, i, stop, outcomes)) for i in range(1, 8)]
        deadline = time.monotonic() + 120
        while most < 3 and time.monotonic() < deadline:
            await asyncio.sleep(1)
            most = max(most, await asyncio.to_thread(_running_workers))
        await asyncio.sleep(2)  # the new replicas take requests too
        stop.set()
        await asyncio.gather(*clients)
    return outcomes, most, time.monotonic()


def test_a_load_ramp_scales_the_workers_up_and_back_down_without_a_failed_request(server):
    assert _running_workers() == 1
    outcomes, most, stopped = asyncio.run(_ramp(server))
    # First: a refused request never reaches a worker, so it cannot scale one up either.
    assert outcomes and all(o == (200, "data: [DONE]") for o in outcomes), [o for o in outcomes if o[0] != 200][:5]
    assert most >= 3
    deadline = stopped + 90
    while _running_workers() > 1:
        assert time.monotonic() < deadline, f"{_running_workers()} workers 90 s after the load stopped"
        time.sleep(1)
    assert _running_workers() == 1
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
