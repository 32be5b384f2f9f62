"""The session's real app for the cluster tests: deploy/serve.yaml brought up with `serve run`
on the session's Ray cluster, two worker replicas of the tiny checkpoint, kv routing. It has
its own name and route, so modules that deploy apps of their own (under the yaml's name) can
come and go beside it. Only tests import this."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from pagefleet.worker.stats import ReplicaStats

SERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"
APP = "pagefleet-session"
ROUTE = "/session"
MAX_MODEL_LEN = 256


def worker_stats() -> dict[str, ReplicaStats]:
    """Each worker replica's published routing stats, keyed by replica id.

    Asks every replica actor directly (the call Serve's controller makes each stats
    period), so no request is routed and every replica answers."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and f"::{APP}#PagefleetWorker#" in a["name"]]
    actors = [ray.get_actor(name, namespace="serve") for name in names]
    stats = ray.get([a.record_routing_stats.remote() for a in actors], timeout=60)
    published = [ReplicaStats.from_routing_stats(s) for s in stats]
    return {s.replica_id: s for s in published}


def start_app(ray_address: str, port: int, ckpt: Path, workdir: Path) -> str:
    """`serve run` the shipped serve.yaml with only sizes, name and route changed; returns the base URL."""
    from ray import serve

    config = yaml.safe_load(SERVE_YAML.read_text())
    config["http_options"]["port"] = port
    config["applications"][0].update(name=APP, route_prefix=ROUTE)
    # A tiny checkpoint and CI-sized resources. 4 MiB of KV per worker is 256 blocks, small
    # enough that the kv routing tests churn through it (evictions included).
    config["applications"][0]["args"].update(model=str(ckpt), workers=2, kv_cache_bytes="4MiB",
                                             max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                             worker_num_cpus=0.5, ingress_num_cpus=0.25)
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = str(Path(sys.executable).parent / "serve")
    done = subprocess.run([serve_cli, "run", "--address", ray_address, "--non-blocking", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    base = f"http://127.0.0.1:{port}{ROUTE}"
    deadline = time.monotonic() + 300
    while True:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            break
        assert status is None or status.status in ("DEPLOYING", "NOT_STARTED"), status
        assert time.monotonic() < deadline, f"app not RUNNING: {status}"
        time.sleep(1)
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    return base
