"""A bare Ray Serve app on a local cluster started as `pagefleet serve` starts its own, for
overhead_parts.py: what Ray and Serve alone cost beside an engine, with none of pagefleet's
processes or code running.

Same cluster set-up as `pagefleet serve` (``launch.start_local_ray``: HAProxy in front when its
binary is there, the quieter control loops, Ray's workers at niceness 0; the control processes at
idle priority once the app is up), and the same shape of app: an ingress deployment behind Serve's
HTTP port holding a handle to a second deployment, one replica each. No global scheduler actor, no
engine, no tokenizer. ``GET /v1/models`` answers after one call through the handle, so a client
sees it as ready as it sees `pagefleet serve`. Runs until SIGINT or SIGTERM.

    python benchmarks/_bare_serve.py PORT
"""

from __future__ import annotations

import os
import signal
import sys
import time

# Before the first `import ray`, as `pagefleet serve` does.
os.environ.setdefault("RAY_AUTH_MODE", "token")

from fastapi import FastAPI  # noqa: E402
from ray import serve  # noqa: E402

from pagefleet.cluster.cpu_priority import idle_control_plane  # noqa: E402
from pagefleet.cluster.launch import start_local_ray  # noqa: E402

api = FastAPI()


@serve.deployment
class Backend:
    def ping(self) -> str:
        return "pong"


@serve.deployment(max_ongoing_requests=4096)
@serve.ingress(api)
class Front:
    def __init__(self, backend) -> None:
        self.backend = backend

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [], "backend": await self.backend.ping.remote()}


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    import ray

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    start_local_ray(os.cpu_count() or 1)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
        serve.run(Front.bind(Backend.bind()), name="bare", route_prefix="/")
        idle_control_plane()
        print("bare Ray Serve app up", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
