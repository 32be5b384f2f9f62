"""Ray's control processes at idle CPU priority, on a cluster ``pagefleet serve`` starts itself.

A served CPU engine computes at the lowest niceness (``worker.cpu.threads``), so that the
request path (HAProxy, the ingress, the worker replica's event loop) takes a core the moment it
has work. But Ray's own processes wake all the time with nothing to do for a request: the GCS,
the dashboard and runtime-env agents, the log monitor, Serve's controller, the global scheduler
actor. Each wake-up at niceness 0 or 15 preempts an engine thread, and with one OpenMP thread per
core the whole step then waits at its barrier for the thread that was preempted
(docs/benchmarks.md has the figures).

``SCHED_IDLE`` (Linux) runs a thread only on a core nothing else wants, and its wake-ups never
preempt: the control plane still gets every cycle it needs on a machine that has any to spare,
later. Any user may put their own processes there (leaving it again needs privilege). Kept out
of it: everything on the request path, and every process that starts others (the raylet starts
worker processes, HAProxy's manager starts HAProxy), since a child inherits the policy. Serve's
Python proxy stays too: behind HAProxy it is only the backup, but it is the one that serves
when the ingress replica is down or not yet in HAProxy's table.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# The local cluster's processes that are off the request path and start no processes of their
# own: Ray's system processes by their program (an argument of the command line that ends so;
# options, which name other programs, do not count), actors and agents by the title Ray gives
# them (``ray::Class`` or ``ray::Class.method``, the whole command line).
PROGRAMS = ("/gcs_server", "/log_monitor.py", "/dashboard/dashboard.py", "/autoscaler/_private/monitor.py")
TITLES = ("ray::ServeController", "ray::GlobalSchedulerActor", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


def is_control_plane(argv: list[str]) -> bool:
    """Whether a process with this command line (``/proc/PID/cmdline`` split at NULs) is one of them."""
    if argv and argv[0].startswith(TITLES):
        return True
    return any(arg.endswith(PROGRAMS) for arg in argv if not arg.startswith("-"))


def _argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace").split("\0")


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (not ``root`` itself), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            children.setdefault(int(text[text.rindex(")") + 2:].split()[1]), []).append(int(name))
    out, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def control_plane_processes(root: int) -> list[int]:
    """The processes below ``root`` (the driver that started the cluster) that go to idle priority."""
    pids = []
    for pid in descendants(root):
        try:
            argv = _argv(pid)
        except OSError:  # exited meanwhile
            continue
        if is_control_plane(argv):
            pids.append(pid)
    return pids


def set_idle_priority(pid: int) -> int:
    """Put every thread of ``pid`` under ``SCHED_IDLE`` (threads it starts later inherit it).
    Returns how many threads were moved; raises OSError where the platform or the process
    refuses (a process gone meanwhile moves 0)."""
    moved = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0
    for tid in tids:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        moved += 1
    return moved


def idle_control_plane(root: int | None = None) -> list[int]:
    """Move the control plane of the cluster this process (or ``root``) started to idle priority.
    Returns the pids moved: none where Linux's ``SCHED_IDLE`` is not there; a process that
    refuses is logged and skipped."""
    if not hasattr(os, "SCHED_IDLE"):
        return []
    moved = []
    for pid in control_plane_processes(os.getpid() if root is None else root):
        try:
            if set_idle_priority(pid):
                moved.append(pid)
        except OSError as e:
            logger.warning("could not lower the CPU priority of Ray process %d: %s", pid, e)
    return moved
