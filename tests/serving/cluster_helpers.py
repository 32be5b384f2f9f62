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


def serve_log_warnings(ray_temp_dir: str, per_file: int = 40, total: int = 150) -> list[str]:
    """The WARNING and ERROR lines of Serve's logs (controller, proxy, replicas) in a Ray temp
    dir, the last ``per_file`` of each file and ``total`` in all, each prefixed with its file."""
    from pathlib import Path

    lines = []
    for path in sorted({p.resolve() for p in Path(ray_temp_dir).glob("session_*/logs/serve/*.log")}):
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        picked = [line for line in text if line.startswith(("WARNING", "ERROR", "CRITICAL"))]
        lines += [f"{path.name}: {line[:400]}" for line in picked[-per_file:]]
    return lines[-total:]


def cpu_watch():
    """Starts watching the cores; the function it returns tells, since then, the seconds passed,
    the machine's busy share (``/proc/stat``), the CPU ms of processes it does not watch (servers
    other tests left, neighbours; and threads that ended meanwhile), and per process role
    (``benchmarks/cpu_contention``; this process's threads as "driver") the CPU ms and the ms
    spent runnable but waiting for a core: what a timing failure on a shared machine is read
    against."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import cpu_contention

    def busy_total() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        idle = ticks[3] + ticks[4]  # idle + iowait
        return sum(ticks) - idle, sum(ticks)

    def sample() -> dict:  # the watched roles' threads, and this test process's as "driver"
        own = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                run_ns, wait_ns = open(f"/proc/self/task/{tid}/schedstat").read().split()[:2]
            except (OSError, ValueError):
                continue
            own[("self", tid)] = ("driver", int(run_ns) / 1e6, int(wait_ns) / 1e6, 0)
        return {**cpu_contention.sample(), **own}

    start, before, machine = time.monotonic(), sample(), busy_total()

    def since() -> dict:
        busy, total = busy_total()
        roles = cpu_contention.role_deltas(before, sample())
        busy_ms = (busy - machine[0]) * 1000 / os.sysconf("SC_CLK_TCK")
        return {"seconds": round(time.monotonic() - start, 1),
                "machine_busy": round((busy - machine[0]) / max(1, total - machine[1]), 2),
                "unwatched_cpu_ms": round(busy_ms - sum(v["cpu_ms"] for v in roles.values())),
                **{r: {"cpu_ms": round(v["cpu_ms"]), "wait_ms": round(v["wait_ms"]),
                       "max_thread_wait_ms": round(v["max_thread_wait_ms"])} for r, v in roles.items()}}
    return since
