"""Helpers for the tests that run a real Serve app: the workers' own published stats, and figures
that benchmarks/reliability.py collects from the reliability battery."""

from __future__ import annotations

import json
import os
import platform
import time

from pagefleet.worker.stats import ReplicaStats

FIGURES_ENV = "PAGEFLEET_FIGURES"  # a file: each figure is appended to it as one JSON line


def listeners() -> dict[int, str]:
    """Every TCP port listened on here (IPv4 and IPv6), mapped to the listening process's
    title (its cmdline's first word: ``ray::ServeReplica:app:deployment``, ``haproxy``...)."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                if fields[3] == "0A":  # LISTEN
                    inodes[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    found: dict[int, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:[") and link[8:-1] in inodes:
                found[inodes[link[8:-1]]] = os.path.basename(title)
    return found


def wait_until_running(app: str, timeout_s: float = 300) -> None:
    """Until Serve reports ``app`` RUNNING; fails at once if it leaves DEPLOYING any other way."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while (status := serve.status().applications.get(app)) is None or status.status != "RUNNING":
        assert status is None or status.status in ("DEPLOYING", "NOT_STARTED"), status
        assert time.monotonic() < deadline, f"app not RUNNING: {status}"
        time.sleep(1)


def worker_actors(app: str | None = None) -> list:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and "PagefleetWorker" in a["name"]
             and (app is None or f"::{app}#" in a["name"])]
    return [ray.get_actor(name, namespace="serve") for name in names]


def worker_stats(app: str | None = None) -> dict[str, ReplicaStats]:
    """Each worker replica's published routing stats, keyed by replica id.

    Asks every replica actor directly (the call Serve's controller makes each stats
    period), so no request is routed and every replica answers."""
    import ray

    actors = worker_actors(app)
    stats = ray.get([a.record_routing_stats.remote() for a in actors], timeout=60)
    published = [ReplicaStats.from_routing_stats(s) for s in stats]
    return {s.replica_id: s for s in published}


def record_figure(name: str, value, target: str | None = None, **detail) -> dict:
    """One measured figure, printed and, when $PAGEFLEET_FIGURES names a file, appended to it."""
    line = {"figure": name, "value": value, "target": target, **detail,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_implementation()} "
                       f"{platform.python_version()}",
            "loadavg_1m": round(os.getloadavg()[0], 2)}  # the machine is shared: how busy it was
    print(json.dumps(line))
    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    return line
