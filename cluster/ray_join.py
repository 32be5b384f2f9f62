"""Joining a running Ray cluster (``pagefleet serve --address``): one-sentence errors, and Serve's state.

Serve runs once per cluster and keeps the HTTP host and port it first started
with; ``pagefleet serve`` refuses to add its app to a Serve that listens
elsewhere (the printed URL would be dead) and, on Ctrl-C, shuts down a Serve it
started itself so nothing is left holding the port.
"""

from __future__ import annotations

from typing import NamedTuple

# Ray Serve's controller actor: its name and namespace are what `serve status` looks up.
SERVE_CONTROLLER = ("SERVE_CONTROLLER_ACTOR", "serve")


def join_error(address: str, exc: BaseException) -> str:
    """The one sentence a user needs when ``ray.init(address=...)`` failed."""
    chain, seen = exc, []
    while chain is not None and chain not in seen:
        seen.append(chain)
        chain = chain.__cause__ or chain.__context__
    auth = any(type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e) for e in seen)
    how = ("set RAY_AUTH_MODE=token and give this machine the cluster's token (copy ~/.ray/auth_token from "
           "the head node, or export RAY_AUTH_TOKEN=<what `ray get-auth-token` prints on the head>)")
    if auth:
        return f"the Ray cluster at {address} refused this machine's credentials: it uses token authentication, so {how}"
    return (f"could not join a Ray cluster at {address} ({type(exc).__name__}): check that `ray start --head` runs "
            f"there and its port is reachable; if it uses token authentication, {how}")


class ServeHTTP(NamedTuple):
    host: str
    port: int


def running_serve_http() -> ServeHTTP | None:
    """Where the cluster's Serve listens, or None when Serve is not running (needs ``ray.init``)."""
    import ray

    name, namespace = SERVE_CONTROLLER
    try:
        controller = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    config = ray.get(controller.get_http_config.remote(), timeout=60)
    return ServeHTTP(config.host, int(config.port))


def serve_conflict(running: ServeHTTP | None, host: str, port: int) -> str | None:
    """Why the app cannot be served at host:port on a Serve already running elsewhere, or None."""
    if running is None or (running.host, running.port) == (host, port):
        return None
    return (f"Ray Serve already runs on this cluster with HTTP on {running.host}:{running.port} and keeps those "
            f"options, so nothing would listen on {host}:{port}: pass --host {running.host} --port {running.port}, "
            f"or stop that Serve first (`serve shutdown`)")
