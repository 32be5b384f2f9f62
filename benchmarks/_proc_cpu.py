"""CPU seconds spent by a process tree, by role: where a server's cycles go, whatever the load.

On a loaded machine wall-clock latency measures the neighbours as much as the server; CPU
time per output token does not. Linux only (reads /proc)."""

from __future__ import annotations

import os

from pagefleet.cluster.cpu_priority import descendants

HZ = os.sysconf("SC_CLK_TCK")
# (cmdline fragment, role): the first that matches names the process. "proxy" is what holds the
# HTTP port: Serve's Python proxy actor, or HAProxy and the actor that manages it.
ROLES = (("PagefleetWorker", "worker"), ("OpenAIIngress", "ingress"), ("ProxyActor", "proxy"), ("haproxy", "proxy"),
         ("GlobalSchedulerActor", "scheduler"), ("ServeController", "controller"))


def _cpu_s(stat_path: str) -> float:
    text = open(stat_path).read()
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / HZ  # utime + stime


def role_of(pid: int | str, roles=ROLES, default: str | None = "other") -> str | None:
    """The role of the first (cmdline fragment, role) of ``roles`` that matches the process, else ``default``."""
    try:
        cmd = open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return default
    return next((role for fragment, role in roles if fragment in cmd), default)


def tree_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and its descendants, summed by role. Everything unnamed
    (Ray's GCS, raylet, dashboard, the CLI itself, vLLM's processes) is ``other``. (Python
    does not name OS threads, so the engine thread is not told apart from its replica.)"""
    totals: dict[str, float] = {}
    for pid in [root, *descendants(root)]:
        try:
            role = role_of(pid)
            totals[role] = totals.get(role, 0.0) + _cpu_s(f"/proc/{pid}/stat")
        except OSError:  # it exited meanwhile
            continue
    return totals


def per_token_ms(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    return {role: round(1000 * (after.get(role, 0.0) - before.get(role, 0.0)) / tokens, 3)
            for role in sorted(after)}


def read_thread(pid: int | str, tid: int | str) -> tuple[float, float, int, int]:
    """(ms on a CPU, ms runnable but waiting on a run queue, niceness, involuntary context
    switches) of one thread; OSError (or ValueError) once it has ended."""
    base = f"/proc/{pid}/task/{tid}"
    run_ns, wait_ns = open(f"{base}/schedstat").read().split()[:2]
    stat = open(f"{base}/stat").read()
    nice = int(stat[stat.rindex(")") + 2:].split()[16])
    status = open(f"{base}/status").read()
    involuntary = int(status.rsplit("nonvoluntary_ctxt_switches:", 1)[1].split()[0])
    return int(run_ns) / 1e6, int(wait_ns) / 1e6, nice, involuntary


def thread_sched(pid: int | str, nice: int | None = None) -> dict[str, tuple[float, float, int]]:
    """tid -> (ms on a CPU, ms runnable but waiting on a run queue, involuntary context switches)
    for the threads of ``pid`` (only those at niceness ``nice``, when given). A thread switched
    out involuntarily was preempted, or its time slice ran out; one that blocks or sleeps
    leaves voluntarily."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            run, wait, thread_nice, involuntary = read_thread(pid, tid)
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        if nice is None or thread_nice == nice:
            out[tid] = (run, wait, involuntary)
    return out


def sched_per_token(before: dict, after: dict, tokens: int, seconds: float) -> dict[str, float]:
    """Between two ``thread_sched`` samples: the threads' CPU and run-queue wait per output token
    and their involuntary context switches per second (a thread born since counts its whole life)."""
    run = wait = switches = 0.0
    for tid, (r, w, s) in after.items():
        r0, w0, s0 = before.get(tid, (0.0, 0.0, 0))
        run, wait, switches = run + r - r0, wait + w - w0, switches + s - s0
    return {"threads": len(after), "cpu_ms_per_token": round(run / tokens, 3),
            "runqueue_wait_ms_per_token": round(wait / tokens, 3),
            "involuntary_switches_per_s": round(switches / seconds, 1)}
