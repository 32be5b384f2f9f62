"""What the ingress makes of a worker's failure, and whether any worker can serve (Ray at the edge).

A failure reaches the ingress as a Ray or Serve exception whose text holds a
traceback, file paths, process ids and addresses: none of that goes to the
client (one sent on a channel connection comes back as the engine's own exception, or
``ChannelLost`` when the connection ended). A request the engine refused is a 400 with the
engine's own message (a 404 ``model_not_found`` for a LoRA adapter it does not hold); a replica that died, or whose engine loop died, or whose connection ended, is
a 503 that may be retried on another replica if the request had produced nothing yet; Serve's queue for
the workers being full is admission control's 429; anything else is a 500 whose details go to the log only.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor

from ray import exceptions as ray_exceptions, serve
from ray.serve import exceptions as serve_exceptions

from pagefleet.router.openai.errors import OpenAIError, bad_request, internal_error, too_many_requests, unavailable
from pagefleet.router.worker_client.delta_mux import ChannelLost
from pagefleet.worker.errors import CompileQueueFull, EngineDeadError
from pagefleet.worker.request_check import MODEL_NOT_FOUND, InvalidRequest

_REPLICA_GONE = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError,
                 serve_exceptions.ReplicaUnavailableError, serve_exceptions.DeploymentUnavailableError, ChannelLost)
HEALTH_CACHE_S = 1.0


def worker_failure(exc: BaseException) -> tuple[OpenAIError, bool]:
    """The OpenAI error for a failed worker call, and whether trying another replica is safe
    (for a request that has produced nothing yet)."""
    if isinstance(exc, OpenAIError):
        return exc, False
    if isinstance(exc, serve_exceptions.BackPressureError):
        retry_after = math.ceil(getattr(exc, "_retry_after_s", None) or 1)
        return too_many_requests("every worker replica is busy and this ingress already holds as many requests "
                                 "waiting for one as it may; retry later", retry_after), False
    cause = exc.cause if isinstance(exc, ray_exceptions.RayTaskError) and exc.cause is not None else exc
    if isinstance(cause, InvalidRequest) and cause.code == MODEL_NOT_FOUND:  # an adapter this worker lacks
        return OpenAIError(str(cause.args[0]), status_code=404, param=cause.param, code=MODEL_NOT_FOUND), False
    if isinstance(cause, InvalidRequest):
        return bad_request(str(cause.args[0]) if cause.args else "invalid request", cause.param,
                           cause.code), False
    if isinstance(cause, CompileQueueFull):  # this client's compiles, or all of them, fill the worker's queue
        return too_many_requests(f"{cause.args[0] if cause.args else 'the grammar compile queue is full'}; "
                                 "retry later", 1), False
    if isinstance(cause, EngineDeadError) or isinstance(cause, _REPLICA_GONE):
        return unavailable("the worker replica serving this request failed; retry the request",
                           code="worker_failed"), True
    return internal_error(exc), False


def engine_died(exc: BaseException) -> bool:
    """Whether a worker call failed because the replica's engine loop died (the replica then
    leaves routing and exits), rather than because the replica went away."""
    cause = exc.cause if isinstance(exc, ray_exceptions.RayTaskError) and exc.cause is not None else exc
    return isinstance(cause, EngineDeadError)


class WorkerHealth:
    """Whether Serve has a RUNNING replica of the worker deployment. Serve's controller health-checks
    each replica directly (``check_health``), outside the request queues, so this answers at once
    even while every replica is busy; the status is asked for at most once a second."""

    def __init__(self, deployment_name: str) -> None:
        self.deployment_name = deployment_name
        self._checked_at = -math.inf
        self._running = 0
        self._lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagefleet-health")

    async def check(self) -> None:
        async with self._lock:
            if time.monotonic() - self._checked_at > HEALTH_CACHE_S:
                # A thread of its own: a busy route's pool never holds up the health probe.
                self._running = await asyncio.get_running_loop().run_in_executor(self._executor,
                                                                                self._running_replicas)
                self._checked_at = time.monotonic()
        if self._running < 1:
            raise RuntimeError(f"no RUNNING replica of {self.deployment_name}")

    def _running_replicas(self) -> int:
        app = serve.get_replica_context().app_name
        status = serve.status().applications.get(app)
        deployment = status.deployments.get(self.deployment_name) if status is not None else None
        if deployment is None:
            return 0
        return int(deployment.replica_states.get("RUNNING", 0))
