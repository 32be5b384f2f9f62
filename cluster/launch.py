"""Bring-up for ``pagefleet serve``: a local Ray (or a joined cluster), Serve, the app, Ctrl-C.

A local cluster runs with Ray's token authentication on (``RAY_AUTH_MODE=token``;
the token is written to ``~/.ray/auth_token``): Ray refuses to run a node on a
loopback address, so its own ports listen on the node's address and the token
is what guards them. The HTTP server binds to loopback unless ``--host`` says
otherwise.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time

from pagefleet.cluster.config import API_KEY_ENV, ServeOptions

def prepare_model(opts: ServeOptions) -> str:
    """Resolve (and, for the demo, write) the checkpoint before any Ray process starts, so a bad
    --model fails in a second and replicas never race to write the demo checkpoint. Returns the
    served model name; ``opts.engine.model`` is the checkpoint directory afterwards."""
    from pagefleet.cluster.demo_model import or_demo_model
    from pagefleet.worker.config import model_config_of

    opts.engine = or_demo_model(opts.engine)
    return model_config_of(opts.engine).served_model_name


def run_server(opts: ServeOptions, *, address: str | None = None) -> int:
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

    from pagefleet.cluster.app import APP_NAME, build_app

    if local:
        # Logical CPUs: replicas reserve Ray CPUs, not cores, so a small machine still fits
        # every replica (they share the cores).
        num_cpus = max(os.cpu_count() or 1, math.ceil(opts.logical_cpus_needed()) + 1)
        ray.init(num_cpus=num_cpus, include_dashboard=False)
    else:
        ray.init(address=address)

    def stop(*_):
        raise KeyboardInterrupt

    # Explicit for SIGINT too: a shell that starts us in the background ignores it by default.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        serve.start(http_options={"host": opts.serve.host, "port": opts.serve.port})
        serve.run(build_app(opts), name=APP_NAME, route_prefix="/")
        print(banner(opts, model_name, time.monotonic() - started, local), flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("pagefleet: shutting down", flush=True)
    finally:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0


def banner(opts: ServeOptions, model_name: str, elapsed_s: float, local: bool) -> str:
    host = "127.0.0.1" if opts.serve.host in ("0.0.0.0", "::") else opts.serve.host
    base = f"http://{host}:{opts.serve.port}"
    # The key itself is never printed: the line names where the user keeps it.
    auth = f" \\\n  -H \"Authorization: Bearer ${API_KEY_ENV}\"" if opts.serve.api_key else ""
    where = "a local Ray cluster (token auth on)" if local else "the Ray cluster"
    return (
        f"\npagefleet: serving {model_name!r} with {opts.serve.workers} worker replica(s) on {where}, "
        f"ready in {elapsed_s:.0f} s\n"
        f"  OpenAI API: {base}/v1   health: {base}/health   metrics: {base}/metrics\n"
        f"  try:\n"
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
        f"\"max_tokens\": 32}}'\n"
        f"  Ctrl-C stops the server{' and the local Ray cluster' if local else ''}.\n"
    )
