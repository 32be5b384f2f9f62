"""KV-aware routing on a real Ray cluster: the session's app (deploy/serve.yaml, two worker
replicas publishing KV events to the global scheduler actor), driven over HTTP.

- 0 drift: after 1,000+ requests with random client aborts, once idle, the scheduler's view of
  each worker equals that worker's own pool exactly (hash set and free blocks), with no
  snapshot needed on the way: the event stream alone is exact.
- Killing the scheduler mid-traffic: every request still succeeds (routed without it, counted
  as fallbacks), and the restarted scheduler rebuilds its view from the workers' snapshots.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from cluster_app import APP, worker_stats
from pagefleet.router.kv_index import routing_keys

NUM_REQUESTS = 1000


@pytest.fixture(scope="module")
def app(server):
    """The session's app: (base URL, model name, the global scheduler actor)."""
    from pagefleet.router.scheduler_actor import get_scheduler

    base, ckpt = server
    return base, ckpt.name, get_scheduler()


def _ingress():
    from ray import serve

    return serve.get_deployment_handle("OpenAIIngress", APP)


def _worker_snapshots() -> dict:
    """Every worker's own KV snapshot, by worker id (the handle routes each call to some replica:
    call until both answered)."""
    from ray import serve

    handle = serve.get_deployment_handle("PagefleetWorker", APP)
    snaps: dict = {}
    for _ in range(60):
        snap = handle.kv_snapshot.remote().result(timeout_s=30)
        snaps[snap.worker_id] = snap
        if len(snaps) == 2:
            return snaps
    raise AssertionError(f"only reached workers {sorted(snaps)}")


def _wait_idle(timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        engines = [s.engine for s in worker_stats().values()]
        if all(e.num_running == 0 and e.num_waiting == 0 for e in engines):
            return
        assert time.monotonic() < deadline, f"workers did not go idle: {engines}"
        time.sleep(0.05)


def _assert_views_equal_pools(scheduler) -> dict:
    import ray

    snaps = _worker_snapshots()
    views = {}
    for worker_id, snap in snaps.items():
        deadline = time.monotonic() + 10
        while True:  # the batch the snapshot was taken at has to reach the scheduler first
            view = ray.get(scheduler.worker_view.remote(worker_id))
            if view is not None and view.seq >= snap.seq:
                break
            assert time.monotonic() < deadline, (worker_id, view, snap.seq)
            time.sleep(0.05)
        assert view.synced
        assert view.routing_keys == set(routing_keys(snap.block_hashes)), worker_id
        assert (view.num_free_blocks, view.num_total_blocks) == (snap.num_free_blocks, snap.num_total_blocks)
        assert snap.num_free_blocks == snap.num_total_blocks  # idle: every block is free (cached or not)
        views[worker_id] = view
    return views


async def _traffic(base: str, model: str, n: int, seed: int, concurrency: int = 12,
                   statuses: list[int] | None = None) -> list[int]:
    """n completions: shared prefixes with random tails (two tenants by cache_salt), some
    streamed to the end, some aborted by the client after the first chunk. Returns the
    status of each (an aborted stream counts as its 200), appended to ``statuses`` as they come."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 300) for _ in range(32)] for _ in range(6)]
    statuses = [] if statuses is None else statuses
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            queue.get_nowait()
            prompt = rng.choice(prefixes) + [rng.randrange(5, 300) for _ in range(rng.randrange(0, 40))]
            body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, 8), "temperature": 0,
                    "ignore_eos": True}
            if rng.random() < 0.5:
                body["cache_salt"] = "tenant-b"
            mode = rng.random()
            if mode < 0.3:  # the client hangs up after the first chunk
                body["max_tokens"] = 64
                async with http.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
                    statuses.append(r.status_code)
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break
            elif mode < 0.6:
                async with http.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
                    statuses.append(r.status_code)
                    lines = [line async for line in r.aiter_lines() if line]
                    assert lines[-1] == "data: [DONE]"
            else:
                r = await http.post(f"{base}/v1/completions", json=body)
                statuses.append(r.status_code)

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return statuses


def test_zero_drift_after_a_thousand_requests_with_aborts(app):
    import ray

    base, model, scheduler = app
    statuses = asyncio.run(_traffic(base, model, NUM_REQUESTS, seed=0))
    assert statuses == [200] * NUM_REQUESTS
    _wait_idle()
    views = _assert_views_equal_pools(scheduler)
    counters = ray.get(scheduler.counters.remote())
    # the stream alone was exact: no batch lost, no snapshot needed to repair a view
    assert (counters.gaps, counters.snapshots_applied) == (0, 0)
    total_blocks = sum(v.num_total_blocks for v in views.values())
    assert counters.block_events > 2 * total_blocks  # the pools were churned through, evictions included
    assert all(v.routing_keys for v in views.values())  # and both workers hold cached prefixes now
    routing = _ingress().routing_counters.remote().result()
    assert sum(routing.decisions.values()) + routing.fallbacks == NUM_REQUESTS
    # some went where their prefix was cached, and the workers did find it there
    assert routing.decisions["prefix"] > 0 and routing.realised_hit_blocks > 0


def test_killing_the_scheduler_mid_traffic_keeps_serving_and_the_restart_rebuilds_from_snapshots(app):
    import ray

    base, model, scheduler = app
    before = _ingress().routing_counters.remote().result().fallbacks
    first_start = ray.get(scheduler.start_time.remote())

    async def run():
        done: list[int] = []
        traffic = asyncio.create_task(_traffic(base, model, 300, seed=1, concurrency=6, statuses=done))
        while len(done) < 50:
            await asyncio.sleep(0.01)
        ray.kill(scheduler, no_restart=False)  # Ray restarts it (max_restarts=-1), empty
        killed_at = len(done)
        statuses = await traffic
        return killed_at, statuses

    killed_at, statuses = asyncio.run(run())
    assert killed_at < 100  # mid-traffic: most requests came after the kill
    assert statuses == [200] * 300  # nothing failed while the scheduler was gone
    assert _ingress().routing_counters.remote().result().fallbacks > before
    _wait_idle()
    assert ray.get(scheduler.start_time.remote()) > first_start  # the same handle reaches the new incarnation
    views = _assert_views_equal_pools(scheduler)
    counters = ray.get(scheduler.counters.remote())
    assert counters.snapshots_applied >= len(views) == 2  # every worker's view came back from a snapshot
