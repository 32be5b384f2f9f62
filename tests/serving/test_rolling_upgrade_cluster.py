"""Replacing the replicas of a running app on the session's Ray cluster, under load: the app
redeployed with a changed worker option (a rolling upgrade: Serve replaces every replica), and the
worker deployment scaled down. Streams in flight finish on the replicas that go (Serve waits up
to ``graceful_shutdown_timeout_s``, the app's drain timeout, before it stops one), and requests
sent meanwhile are served."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from cluster_helpers import StreamedCompletion, record_figure, wait_until_running, worker_stats
from conftest import free_port

APP = "pagefleet-roll"
PREFIX = "/roll"
ARGS = {"workers": 2, "kv_cache_bytes": "16MiB", "max_model_len": 1024, "max_num_seqs": 8, "worker_num_cpus": 0.5,
        "ingress_num_cpus": 0.25, "drain_timeout_s": 120.0}
STREAMS = 16
MAX_TOKENS = 200
# Streams that outlast a `serve run` of a config: its process starts, Serve builds the app in a
# task of its own, then changes the replicas.
LONG_MAX_TOKENS = 800


def _deploy(ckpt, **changes) -> None:
    from ray import serve

    from pagefleet.cluster.app import build_app

    serve.run(build_app({"model": str(ckpt), **ARGS, **changes}), name=APP, route_prefix=PREFIX, blocking=False)


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_checkpoint):
    from ray import serve

    from pagefleet.router.global_scheduler.actor import stop_scheduler

    serve.shutdown()  # a fresh proxy on a port of our own (another module may have started one)
    stop_scheduler()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    ckpt = tiny_checkpoint("llama")
    _deploy(ckpt)
    wait_until_running(APP)
    base = f"http://127.0.0.1:{port}{PREFIX}"
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    yield base, ckpt, port, ray_cluster
    serve.shutdown()
    stop_scheduler()


def _streams(base: str, model: str, n: int, max_tokens: int) -> list[StreamedCompletion]:
    streams = [StreamedCompletion(f"{base}/v1/completions", {
        "model": model, "prompt": f"upgrade {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}) for i in range(n)]
    for s in streams:
        s.start()
    return streams


def _in_engines(streams: list[StreamedCompletion], timeout_s: float = 120) -> dict[str, int]:
    """Until the workers' engines hold every stream (running or waiting); each worker's count."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = {rid: s.engine.num_running + s.engine.num_waiting for rid, s in worker_stats(APP).items()}
        if sum(running.values()) >= len(streams):
            return running
        assert time.monotonic() < deadline, (running, [s.outcome() for s in streams if not s.is_alive()])
        time.sleep(0.05)


class _Trickle(threading.Thread):
    """Short requests one after another until stopped: the status (or client error) of each, and
    the longest one took."""

    def __init__(self, base: str, model: str) -> None:
        super().__init__(daemon=True)
        self.base, self.model = base, model
        self.stop = threading.Event()
        self.answers: list = []
        self.slowest_s = 0.0

    def run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    r = http.post(f"{self.base}/v1/completions",
                                  json={"model": self.model, "prompt": "meanwhile", "max_tokens": 4})
                    self.answers.append(r.status_code if r.status_code == 200 else (r.status_code, r.text[:200]))
                except httpx.HTTPError as exc:
                    self.answers.append(repr(exc))
                self.slowest_s = max(self.slowest_s, time.monotonic() - sent)
                time.sleep(0.2)


class _Watch(threading.Thread):
    """Until every stream has ended: for each deployment, how many streams were still running
    when Serve first reported one of its replicas STOPPING (draining), and when."""

    def __init__(self, streams: list[StreamedCompletion]) -> None:
        super().__init__(daemon=True)
        self.streams = streams
        self.started = time.monotonic()
        self.running_at_stop: dict[str, int] = {}
        self.first_stop_s: dict[str, float] = {}

    def run(self) -> None:
        from ray import serve

        while any(s.is_alive() for s in self.streams):
            running = sum(not s.done for s in self.streams)
            for name, d in serve.status().applications[APP].deployments.items():
                if d.replica_states.get("STOPPING", 0) and name not in self.running_at_stop:
                    self.running_at_stop[name] = running
                    self.first_stop_s[name] = round(time.monotonic() - self.started, 1)
            time.sleep(0.05)


def _under_load(server, redeploy, max_tokens: int) -> dict:
    """``STREAMS`` streams running on the workers, and a trickle of short requests, while
    ``redeploy()`` changes the app: what each saw, and the times."""
    base, ckpt, _, _ = server
    model = ckpt.name
    before = set(worker_stats(APP))
    streams = _streams(base, model, STREAMS, max_tokens)
    on_each = _in_engines(streams)
    trickle = _Trickle(base, model)
    trickle.start()
    watch = _Watch(streams)
    watch.start()
    redeploy()
    watch.join(600)
    streams_done_s = max(s.ended_at for s in streams) - watch.started
    wait_until_running(APP)
    rolled_s = time.monotonic() - watch.started
    time.sleep(2)  # requests on the new replicas alone
    trickle.stop.set()
    trickle.join(120)
    return {"outcomes": [s.outcome() for s in streams], "before": before, "after": set(worker_stats(APP)),
            "on_each": on_each, "running_at_stop": watch.running_at_stop, "first_stop_s": watch.first_stop_s,
            "new": trickle.answers, "slowest_new_s": round(trickle.slowest_s, 1), "streams_done_s": streams_done_s, "rolled_s": rolled_s}


def test_a_rolling_upgrade_under_16_streams_fails_none(server):
    from ray import serve

    from pagefleet.cluster.app import build_app

    _, ckpt, _, _ = server
    # A changed engine option: Serve replaces every replica of both deployments.
    app = build_app({"model": str(ckpt), **ARGS, "max_num_seqs": 10})
    seen = _under_load(server, lambda: serve.run(app, name=APP, route_prefix=PREFIX, blocking=False), MAX_TOKENS)
    record_figure("rolling_upgrade_s", round(seen["rolled_s"], 1), streams=STREAMS, max_tokens=MAX_TOKENS,
                  streams_done_s=round(seen["streams_done_s"], 1), running_before=seen["on_each"],
                  first_stop_s=seen["first_stop_s"], streams_running_at_first_stop=seen["running_at_stop"],
                  new_requests=len(seen["new"]), slowest_new_s=seen["slowest_new_s"])
    assert seen["outcomes"] == [(200, True, [], MAX_TOKENS, None)] * STREAMS
    assert sum(seen["on_each"].values()) == STREAMS and 0 not in seen["on_each"].values()  # both old workers
    assert seen["running_at_stop"]["PagefleetWorker"] > 0  # a worker replica stopped with streams on it
    assert seen["running_at_stop"]["OpenAIIngress"] > 0
    assert len(seen["after"]) == 2 and not seen["after"] & seen["before"]  # every worker was replaced
    assert [a for a in seen["new"] if a != 200] == [] and len(seen["new"]) > 0


def _serve_run_config(server, tmp_path, **app) -> None:
    """``serve run`` of a config (the declarative API, what ``serve deploy`` and a RayService's
    serveConfigV2 use) with this module's app and ``app``'s keys added."""
    _, ckpt, port, ray_address = server
    config = {"http_options": {"host": "127.0.0.1", "port": port}, "applications": [{
        "name": APP, "route_prefix": PREFIX, "import_path": "pagefleet.cluster.app:build_app",
        "args": {"model": str(ckpt), **ARGS}, **app}]}
    path = tmp_path / f"serve-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "ray.serve.scripts", "run", "--address", ray_address,
                           "--non-blocking", str(path)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_scaling_the_workers_down_under_16_streams_drains_the_one_that_goes(server, tmp_path):
    """A config's ``num_replicas`` for the worker deployment, its args unchanged: Serve keeps the
    code version, stops one replica and keeps the other (a change of ``args`` would replace them
    all, as in the rolling upgrade)."""
    _serve_run_config(server, tmp_path)  # the app as a config first: a new code version, every replica new
    wait_until_running(APP)
    seen = _under_load(server, lambda: _serve_run_config(
        server, tmp_path, deployments=[{"name": "PagefleetWorker", "num_replicas": 1}]), LONG_MAX_TOKENS)
    record_figure("scale_down_s", round(seen["rolled_s"], 1), streams=STREAMS, max_tokens=LONG_MAX_TOKENS,
                  streams_done_s=round(seen["streams_done_s"], 1), running_before=seen["on_each"],
                  first_stop_s=seen["first_stop_s"], streams_running_at_first_stop=seen["running_at_stop"],
                  new_requests=len(seen["new"]), slowest_new_s=seen["slowest_new_s"])
    assert seen["outcomes"] == [(200, True, [], LONG_MAX_TOKENS, None)] * STREAMS
    assert sum(seen["on_each"].values()) == STREAMS and 0 not in seen["on_each"].values()
    assert seen["running_at_stop"]["PagefleetWorker"] > 0
    assert "OpenAIIngress" not in seen["running_at_stop"]  # nothing else changed
    assert len(seen["after"]) == 1 and seen["after"] < seen["before"]  # the one that stays is an old one
    assert [a for a in seen["new"] if a != 200] == [] and len(seen["new"]) > 0
