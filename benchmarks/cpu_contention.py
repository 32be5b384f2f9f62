"""Who gets the cores: CPU time and run-queue wait per second of pagefleet's and Ray's processes.

On a small machine the serving path (ingress, scheduler actor, HAProxy) shares the cores with
the engines, and a latency such as the time to a 429 is mostly time spent runnable but not
running. Linux counts both per thread (``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on a
CPU, nanoseconds waiting on a run queue). Run this beside a benchmark; every ``--interval-s`` it
prints one JSON line with, per process role (as ``_proc_cpu.ROLES`` names them, plus Ray's GCS
and raylet), the CPU ms/s, the run-queue wait ms/s summed over the role's threads, the largest
wait ms/s of a single thread (an event loop's is what its requests wait), and the niceness of
its threads. A thread that ends between two samples is not counted (Linux then keeps its time
only in its process's total). Linux only.

    python benchmarks/cpu_contention.py --seconds 170 --out /tmp/contention.jsonl &
    python benchmarks/routing.py --policies kv
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Callable

from _proc_cpu import ROLES, read_thread, role_of

WATCHED = (*ROLES, ("gcs_server", "gcs"), ("raylet", "raylet"))


def role(pid: str) -> str | None:
    """The process's role, None for a process this does not watch."""
    return role_of(pid, WATCHED, default=None)


def sample(role_of_pid: Callable[[str], str | None] = role) -> dict[tuple[str, str], tuple[str, float, float, int]]:
    """(pid, tid) -> (role, ms on a CPU, ms waiting on a run queue, nice), for every thread of a
    process with a role (``role_of_pid``: a pid's role, None for one not watched)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        r = role_of_pid(pid)
        if r is None:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                run, wait, nice, _ = read_thread(pid, tid)
            except (OSError, ValueError, IndexError):  # the thread ended meanwhile
                continue
            out[(pid, tid)] = (r, run, wait, nice)
    return out


def role_deltas(before: dict, after: dict) -> dict[str, dict]:
    """Per role, between two samples: ms on a CPU and ms waiting on a run queue summed over its
    threads, the largest single thread's wait, and the threads' niceness values."""
    roles: dict[str, dict] = {}
    for key, (r, run, wait, nice) in after.items():
        _, run0, wait0, _ = before.get(key, (r, 0.0, 0.0, nice))  # a thread born since: its whole life
        row = roles.setdefault(r, {"cpu_ms": 0.0, "wait_ms": 0.0, "max_thread_wait_ms": 0.0, "nice": set()})
        row["cpu_ms"] += run - run0
        row["wait_ms"] += wait - wait0
        row["max_thread_wait_ms"] = max(row["max_thread_wait_ms"], wait - wait0)
        row["nice"].add(nice)
    return dict(sorted(roles.items()))


def per_role(before: dict, after: dict, seconds: float) -> dict[str, dict]:
    """``role_deltas`` per second of ``seconds``."""
    return {r: {"cpu_ms_per_s": round(row["cpu_ms"] / seconds, 1), "wait_ms_per_s": round(row["wait_ms"] / seconds, 1),
                "max_thread_wait_ms_per_s": round(row["max_thread_wait_ms"] / seconds, 1), "nice": sorted(row["nice"])}
            for r, row in role_deltas(before, after).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="how long to sample")
    p.add_argument("--interval-s", type=float, default=5.0)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args()
    out = Path(args.out) if args.out else None
    end = time.monotonic() + args.seconds
    before, at = sample(), time.monotonic()
    while time.monotonic() < end:
        time.sleep(args.interval_s)
        after, now = sample(), time.monotonic()
        line = json.dumps({"t": time.strftime("%H:%M:%S"), "roles": per_role(before, after, now - at)})
        print(line, flush=True)
        if out is not None:
            with out.open("a") as f:
                f.write(line + "\n")
        before, at = after, now


if __name__ == "__main__":
    main()
