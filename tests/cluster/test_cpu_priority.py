"""cluster/cpu_priority.py: which processes of a local cluster go to idle CPU priority, and that
every thread of each does, on a real process tree shaped like the one `pagefleet serve` starts."""

import os
import subprocess
import sys
import time

import pytest

from pagefleet.cluster.cpu_priority import (
    control_plane_processes,
    idle_control_plane,
    is_control_plane,
    set_idle_priority,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")

# Starts argv[1] more threads and sleeps; with $CHILD set, first starts one more such process
# below itself whose argv[0] (what Ray's process titles replace) is $CHILD.
SLEEPER = """
import os, subprocess, sys, threading, time
child = os.environ.pop("CHILD", None)
if child:
    subprocess.Popen([child, "-c", os.environ["SLEEPER"], "0"], executable=sys.executable)
for _ in range(int(sys.argv[1])):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
time.sleep(60)
"""

A = "/venv/lib/python3.11/site-packages/ray"


def _start(argv0: str, *args: str, threads: int = 0, child: str | None = None) -> subprocess.Popen:
    """A stand-in process whose command line is ``argv0 -c SLEEPER threads args...``."""
    env = {**os.environ, "SLEEPER": SLEEPER, **({"CHILD": child} if child else {})}
    return subprocess.Popen([argv0, "-c", SLEEPER, str(threads), *args], executable=sys.executable, env=env)


def _tids(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _children(pid: int) -> list[int]:
    return [int(c) for t in _tids(pid) for c in open(f"/proc/{pid}/task/{t}/children").read().split()]


def _wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.fixture
def cluster_tree():
    """The GCS, the raylet (whose options name the agents' scripts, and which starts the actors'
    worker processes: here the Serve controller), the log monitor, the replicas, the proxy and
    the scheduler actor, each with its own threads."""
    py = sys.executable
    procs = {"gcs": _start(py, f"{A}/core/src/ray/gcs/gcs_server", "--log_dir=/tmp", threads=2),
             "raylet": _start(py, f"{A}/core/src/ray/raylet/raylet", f"--dashboard_agent_command={py} {A}/dashboard/"
                              f"agent.py", f"--log_monitor={A}/_private/log_monitor.py",
                              child="ray::ServeController.listen_for_change"),
             "log_monitor": _start(py, "-u", f"{A}/_private/log_monitor.py", "--session-dir=/tmp"),
             "agent": _start("ray::DashboardAgent"),
             "worker": _start("ray::ServeReplica:pagefleet:PagefleetWorker", threads=3),
             "ingress": _start("ray::ServeReplica:pagefleet:OpenAIIngress"),
             "proxy": _start("ray::ProxyActor"),
             "haproxy_manager": _start("ray::HAProxyManager"),
             "scheduler": _start("ray::GlobalSchedulerActor.publish", threads=1)}
    pids = {role: p.pid for role, p in procs.items()}
    pids["controller"] = _wait_for(lambda: (_children(pids["raylet"]) or [None])[0])
    _wait_for(lambda: len(_tids(pids["gcs"])) == 3 and len(_tids(pids["worker"])) == 4)
    yield pids
    os.kill(pids["controller"], 9)
    for p in procs.values():
        p.kill()
        p.wait()


def test_programs_count_as_arguments_not_as_options_and_titles_as_the_whole_command_line():
    assert is_control_plane([f"{A}/core/src/ray/gcs/gcs_server", "--log_dir=/tmp"])
    assert is_control_plane(["python", "-u", f"{A}/_private/log_monitor.py", "--session-dir=/s"])
    assert is_control_plane(["ray::ServeController.listen_for_change", ""])
    assert not is_control_plane([f"{A}/core/src/ray/raylet/raylet", f"--agent={A}/dashboard/dashboard.py"])
    assert not is_control_plane(["ray::ServeReplica:pagefleet:OpenAIIngress"])
    assert not is_control_plane(["python", "-c", "x", "ray::ServeController"])  # a title only as argv[0]
    assert not is_control_plane([""])


def test_the_control_plane_is_chosen_and_the_request_path_and_process_starters_are_not(cluster_tree):
    pids = cluster_tree
    chosen = set(control_plane_processes(os.getpid())) & set(pids.values())
    assert chosen == {pids[r] for r in ("gcs", "log_monitor", "agent", "controller", "scheduler")}
    # The same processes outside the tree of the process that started them are not its cluster's.
    assert control_plane_processes(pids["worker"]) == []


def test_every_thread_of_the_control_plane_goes_idle_and_nothing_else_does(cluster_tree):
    pids = cluster_tree
    idle = ("gcs", "log_monitor", "agent", "controller", "scheduler")
    assert {pids[r] for r in idle} <= set(idle_control_plane(root=os.getpid()))
    for role, pid in pids.items():
        policies = {os.sched_getscheduler(t) for t in _tids(pid)}
        assert policies == ({os.SCHED_IDLE} if role in idle else {os.SCHED_OTHER}), role


def test_set_idle_priority_counts_the_threads_it_moved(cluster_tree):
    assert set_idle_priority(cluster_tree["worker"]) == 4  # the main thread and its three
    assert set_idle_priority(2 ** 22 + 1) == 0  # no such process: nothing moved, no error
