"""The real app of test_server_cluster: deploy/serve.yaml brought up with `serve run` on the
session's Ray cluster (two worker replicas of the tiny checkpoint, kv routing), and helpers that
look at its workers and its global scheduler. Only tests import this.

(`serve run` with a config file replaces every app on the cluster, so each module that deploys
one brings up its own.)"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from pagefleet.router.global_scheduler.kv_index import routing_keys
from pagefleet.worker.metrics.stats import ReplicaStats

import cluster_helpers

SERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"
APP = "pagefleet"
MAX_MODEL_LEN = 256


def worker_stats() -> dict[str, ReplicaStats]:
    """Each worker replica's published routing stats, keyed by replica id (this app's workers)."""
    return cluster_helpers.worker_stats(APP)


def start_app(ray_address: str, port: int, ckpt: Path | str, workdir: Path, **args) -> str:
    """`serve run` the shipped serve.yaml with only sizes changed (and ``args``); returns the base URL."""

    config = yaml.safe_load(SERVE_YAML.read_text())
    config["http_options"]["port"] = port
    # A tiny checkpoint and CI-sized resources. 4 MiB of KV per worker is 256 blocks, small
    # enough that the kv routing tests churn through it (evictions included).
    config["applications"][0]["args"].update({"model": str(ckpt), "workers": 2, "kv_cache_bytes": "4MiB",
                                              "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8,
                                              "worker_num_cpus": 0.5, "ingress_num_cpus": 0.25, **args})
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = str(Path(sys.executable).parent / "serve")
    done = subprocess.run([serve_cli, "run", "--address", ray_address, "--non-blocking", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    base = f"http://127.0.0.1:{port}"
    cluster_helpers.wait_until_running(APP)
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    return base


def ingress():
    from ray import serve

    return serve.get_deployment_handle("OpenAIIngress", APP)


def worker_snapshots(timeout_s: float = 90.0, workers: int = 2) -> dict:
    """Every worker's own KV snapshot, by worker id (the handle routes each call to some replica:
    call until all ``workers`` answered). The handle ranks the replicas by the load they last published (every
    second, through Serve's controller): one that looked busy is passed over until that refreshes,
    which a loaded machine can hold back for many seconds (100 calls 0.1 s apart once reached one
    replica only), so this is bounded by time, not by a count of calls."""
    from ray import serve

    handle = serve.get_deployment_handle("PagefleetWorker", APP)
    snaps: dict = {}
    deadline = time.monotonic() + timeout_s
    while True:
        snap = handle.kv_snapshot.remote().result(timeout_s=30)
        snaps[snap.worker_id] = snap
        if len(snaps) == workers:
            return snaps
        assert time.monotonic() < deadline, f"only reached workers {sorted(snaps)} in {timeout_s} s"
        time.sleep(0.25)


def wait_idle(timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        engines = [s.engine for s in worker_stats().values()]
        if all(e.num_running == 0 and e.num_waiting == 0 for e in engines):
            return
        assert time.monotonic() < deadline, f"workers did not go idle: {engines}"
        time.sleep(0.05)


def assert_views_equal_pools(scheduler, ingress_replicas: int = 1, workers: int = 2) -> dict:
    """The scheduler actor's view of each of the ``workers`` running, and every ingress replica's
    copy of it (what requests are routed with), each equal to the worker's own pool; returns the
    actor's views."""
    import ray

    snaps = worker_snapshots(workers=workers)
    views = {}
    for worker_id, snap in snaps.items():
        view = _caught_up("actor", worker_id, snap.seq, lambda: ray.get(scheduler.worker_view.remote(worker_id)))
        _assert_view_equals_pool("actor", view, snap)
        views[worker_id] = view
        # the handle calls one replica at a time: call until each has answered with its copy caught up
        copies: dict[str, object] = {}
        deadline = time.monotonic() + 30
        while len(copies) < ingress_replicas:
            answer = ingress().counters.remote(worker_id).result()
            if answer.worker_view is not None and answer.worker_view.seq >= snap.seq:
                copies[answer.replica_id] = answer.worker_view
            assert time.monotonic() < deadline, ("ingress copies", worker_id, sorted(copies), snap.seq)
            time.sleep(0.02)
        for replica_id, copy in copies.items():
            _assert_view_equals_pool(f"ingress copy {replica_id}", copy, snap)
    return views


def _caught_up(name: str, worker_id: str, seq: int, read):
    """``read()``'s view once it has applied the batch numbered ``seq`` (the snapshot's)."""
    deadline = time.monotonic() + 10
    while True:
        view = read()
        if view is not None and view.seq >= seq:
            return view
        assert time.monotonic() < deadline, (name, worker_id, view, seq)
        time.sleep(0.05)


def _assert_view_equals_pool(name: str, view, snap) -> None:
    assert view.synced, name
    assert view.routing_keys == set(routing_keys(snap.block_hashes)), (name, snap.worker_id)
    assert view.in_use_keys == set(routing_keys(snap.in_use_hashes)) == set(), (name, snap.worker_id)
    assert (view.num_free_blocks, view.num_total_blocks) == (snap.num_free_blocks, snap.num_total_blocks), name
    assert snap.num_free_blocks == snap.num_total_blocks  # idle: every block is free (cached or not)


async def traffic(base: str, model: str, n: int, seed: int, concurrency: int = 12,
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
                    assert lines[-1] == "data: [DONE]", (r.status_code, lines[-2:])
            else:
                r = await http.post(f"{base}/v1/completions", json=body)
                statuses.append(r.status_code)

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return statuses
