"""Helpers for the tests that run a real Serve app: the workers' own published stats, streamed
completions read on threads, and figures that benchmarks/reliability.py collects from the
reliability battery."""

from __future__ import annotations

import json
import os
import platform
import threading
import time

import httpx

from pagefleet.worker.metrics.stats import ReplicaStats

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


def serve_log_warnings(ray_temp_dir: str, per_file: int = 40, total: int = 200) -> list[str]:
    """The WARNING and ERROR records of Serve's logs (replicas and proxy first, the controller's
    last, so that a cut keeps them), with up to 8 lines of each one's traceback: the last
    ``per_file`` records of each file and ``total`` lines in all, each prefixed with its file."""
    from pathlib import Path

    paths = sorted({p.resolve() for p in Path(ray_temp_dir).glob("session_*/logs/serve/*.log")},
                   key=lambda p: (p.name.startswith("controller"), p.name))
    lines = []
    for path in paths:
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        records, keep = [], False
        for line in text:
            if line.startswith(("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")):
                keep = line.startswith(("WARNING", "ERROR", "CRITICAL"))
                if keep:
                    records.append([line])
            elif keep and len(records[-1]) < 9:
                records[-1].append(line)
        lines += [f"{path.name}: {line[:400]}" for record in records[-per_file:] for line in record]
    return lines[-total:]


def _cpu_contention():
    """benchmarks/cpu_contention.py (per-thread schedstat by process role)."""
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import cpu_contention

    return cpu_contention


def session_threads() -> dict:
    """Every thread of this test process ("driver") and of the processes below it (this session's
    Ray cluster, by ``cpu_contention``'s roles), as ``cpu_contention.sample`` gives them:
    (pid, tid) -> (role, CPU ms, run-queue wait ms, niceness). Another Ray on the machine is not in it."""
    from pagefleet.cluster.cpu_priority import descendants

    contention = _cpu_contention()
    me = str(os.getpid())
    below = {str(pid) for pid in descendants(os.getpid())}
    return contention.sample(lambda pid: "driver" if pid == me else contention.role(pid) if pid in below else None)


def cpu_watch():
    """Starts watching the cores; the function it returns tells, since then, the seconds passed,
    the machine's busy share and the CPU ms stolen by the hypervisor (``/proc/stat``), the CPU ms
    of processes outside this session's cluster (other tests' servers, neighbours; and threads
    that ended meanwhile), and per role of ``session_threads`` the CPU ms and the ms spent
    runnable but waiting for a core: what a timing failure on a shared machine is read against."""
    hz = os.sysconf("SC_CLK_TCK")
    role_deltas = _cpu_contention().role_deltas

    def ticks() -> tuple[int, int, int]:  # busy, busy + idle, stolen
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        busy = user + nice + system + irq + softirq
        return busy, busy + idle + iowait, steal

    start, before, machine = time.monotonic(), session_threads(), ticks()

    def since() -> dict:
        now = ticks()
        busy, total, steal = (a - b for a, b in zip(now, machine))
        roles = role_deltas(before, session_threads())
        return {"seconds": round(time.monotonic() - start, 1), "machine_busy": round(busy / max(1, total), 2),
                "steal_ms": round(steal * 1000 / hz),
                "outside_cpu_ms": round(busy * 1000 / hz - sum(v["cpu_ms"] for v in roles.values())),
                **{r: {"cpu_ms": round(v["cpu_ms"]), "wait_ms": round(v["wait_ms"]),
                       "max_thread_wait_ms": round(v["max_thread_wait_ms"])} for r, v in roles.items()}}
    return since


class StreamedCompletion(threading.Thread):
    """One streamed completion on a thread of its own: its data events, and ``started`` set at the
    first one (or when it fails). Events are split on blank lines only, as SSE says: generated text
    may hold characters (U+2028, U+0085) that a line reader splits JSON on."""

    def __init__(self, url: str, body: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.started = threading.Event()
        self.data: list[str] = []
        self.status: int | None = None
        self.error: str | None = None
        self.ended_at: float | None = None  # time.monotonic()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=300) as r:
                self.status = r.status_code
                pending = b""
                for part in r.iter_bytes():
                    *events, pending = (pending + part).split(b"\n\n")
                    self.data += [e.decode()[6:] for e in events if e.startswith(b"data: ")]
                    if self.data:
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    @property
    def done(self) -> bool:
        return self.data[-1:] == ["[DONE]"]

    def outcome(self) -> tuple:
        """(status, ends with [DONE], its error events, completion tokens in its usage chunk, a
        client error)."""
        events = [json.loads(d) for d in self.data if d != "[DONE]"]
        usage = [e["usage"] for e in events if e.get("usage")]
        return (self.status, self.done, [e for e in events if "error" in e],
                usage[-1]["completion_tokens"] if usage else None, self.error)
