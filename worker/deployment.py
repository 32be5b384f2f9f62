"""The worker as a Ray Serve deployment: the only Ray-importing file in worker/.

``WorkerReplica`` is plain Python around one ``AsyncLLMEngine`` (injectable,
as in Ray Serve LLM); ``worker_deployment`` binds it into a Serve deployment.
The engine's step loop runs in its own thread, so this replica's event loop
stays free for new requests, aborts, health checks and stats.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

from ray import serve
from ray.serve import Application

from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.stats import ReplicaStats

logger = logging.getLogger(__name__)

WORKER_DEPLOYMENT_NAME = "PagefleetWorker"


def _default_engine(args: EngineArgs):
    from pagefleet.worker.async_engine import AsyncLLMEngine
    from pagefleet.worker.metrics_recorder import RayEngineMetricsRecorder

    def recorder(cfg):
        return RayEngineMetricsRecorder(cfg.served_model_name, _replica_id(), cfg.max_model_len)

    return AsyncLLMEngine(args, metrics=recorder)


class WorkerReplica:
    """One engine (one TP group) per replica; every method is cheap except ``generate``."""

    def __init__(self, engine_args: EngineArgs, engine_factory: Callable[[EngineArgs], Any] = _default_engine) -> None:
        self.engine = engine_factory(engine_args)
        self.replica_id = _replica_id()
        self.num_requests_total = 0
        cfg = self.engine.model_config
        logger.info("worker replica %s serves %s (max_model_len %d)", self.replica_id, cfg.served_model_name,
                    cfg.max_model_len)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutputDelta]:
        """Streams one delta per engine step. When the caller cancels (a client hung up),
        Serve cancels this generator and the engine aborts the request and frees its blocks."""
        self.num_requests_total += 1
        async for delta in self.engine.generate(request_id, prompt_token_ids, params):
            yield delta

    async def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    async def check_health(self) -> None:
        """Serve's health probe (raising marks this replica unhealthy and Serve replaces it), also
        routed like a request by the ingress's /health. The engine raises when its loop died or it
        has work but stopped stepping."""
        self.engine.check_health()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Published to the request router every stats period (see ``request_router_config``)."""
        return self.stats().to_routing_stats()

    def stats(self) -> ReplicaStats:
        try:
            self.engine.check_health()
            healthy = True
        except Exception:
            healthy = False
        return ReplicaStats(replica_id=self.replica_id, healthy=healthy,
                            num_requests_total=self.num_requests_total, engine=self.engine.stats())

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests that build the class directly)
        return "local"


def worker_deployment_options(engine_args: EngineArgs, *, num_replicas: int = 1, num_cpus: float = 1.0,
                              num_gpus_per_rank: float = 0.0, name: str = WORKER_DEPLOYMENT_NAME,
                              **deployment_options: Any) -> dict[str, Any]:
    """``serve.deployment`` options for ``num_replicas`` engines of ``engine_args``.

    A tensor-parallel engine gets a placement group of one bundle per rank,
    STRICT_PACK so its ranks share a node (all-reduce stays on NVLink or
    loopback): bundle 0 holds the replica itself (rank 0), bundles 1..N-1 the
    rank actors the engine starts. ``deployment_options`` (request router
    config, health periods, ...) override or extend these.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if num_cpus < 0 or num_gpus_per_rank < 0:
        raise ValueError("num_cpus and num_gpus_per_rank must be >= 0")
    tp = engine_args.tensor_parallel_size
    options: dict[str, Any] = {
        "name": name,
        "num_replicas": num_replicas,
        # Requests beyond this wait in Serve's router queue, where they can still go to another
        # replica, rather than in one engine's waiting queue.
        "max_ongoing_requests": 2 * engine_args.max_num_seqs,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus_per_rank},
    }
    if tp > 1:
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus_per_rank} if num_gpus_per_rank else {})}
        options["placement_group_bundles"] = [dict(bundle) for _ in range(tp)]
        options["placement_group_strategy"] = "STRICT_PACK"
    options.update(deployment_options)
    return options


def worker_deployment(engine_args: EngineArgs, *, engine_factory: Callable[[EngineArgs], Any] | None = None,
                      **options: Any) -> Application:
    """Bind ``WorkerReplica`` into a Serve deployment (options: ``worker_deployment_options``)."""
    deployment = serve.deployment(WorkerReplica, **worker_deployment_options(engine_args, **options))
    if engine_factory is None:
        return deployment.bind(engine_args)
    return deployment.bind(engine_args, engine_factory)
