"""The Serve application: the OpenAI ingress in front of N worker replicas (or MIN to MAX, which
Ray Serve scales between: ``worker.replica.autoscaling``).

``build_app`` is the app builder that ``serve run``, ``serve deploy`` and
KubeRay's RayService use (``import_path: pagefleet.cluster.app:build_app``,
options under ``args:``); ``pagefleet serve`` builds the same app with ``pagefleet_app``,
handing its ingress replicas the actor it drains them through (``cluster.drain``). With ``kv`` routing
(the default) it also starts the global scheduler actor (one per cluster,
detached: see ``router.global_scheduler.actor``), which both deployments talk to.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from pagefleet.cluster.config import ServeOptions
from pagefleet.cluster.demo.model import or_demo_model
from pagefleet.router.global_scheduler.actor import start_scheduler
from pagefleet.router.ingress import INGRESS_DEPLOYMENT_NAME, OpenAIIngress
from pagefleet.router.lora_registry import start_lora_registry
from pagefleet.router.openai.http_guards import BodyLimits
from pagefleet.router.openai.preprocess import ServingLimits
from pagefleet.router.openai.tool_choice import ToolCallOptions
from pagefleet.router.routing.request_router import ROUTER_CLASSES
from pagefleet.worker.cpu.threads import available_cores, compute_thread_env
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.replica.deployment import worker_deployment

APP_NAME = "pagefleet"
# How often each worker publishes its load to the routers: fresh enough to steer
# around a busy replica, cheap enough to be noise (one small actor call).
ROUTING_STATS_PERIOD_S = 1.0


def build_app(args: Mapping[str, Any] | ServeOptions | None = None) -> Application:
    """Serve's app builder (it passes exactly one argument: the ``args`` of the config)."""
    return pagefleet_app(args if isinstance(args, ServeOptions) else ServeOptions.from_dict(args))


def pagefleet_app(opts: ServeOptions, drain_board: Any = None) -> Application:
    """The app; ``drain_board``: the ``cluster.drain.DrainBoard`` actor that ``pagefleet serve``
    drains every ingress replica through (None: no such command, as under ``serve run``)."""
    engine_args = or_demo_model(opts.engine_args_for_this_machine(available_cores()))
    serve_args = opts.serve
    gpus = serve_args.worker_num_gpus
    if gpus is None:
        gpus = 1.0 if _cluster_has_gpus() and engine_args.device != "cpu" and engine_args.simulate is None else 0.0
    kv_scheduler = start_scheduler() if serve_args.routing == "kv" else None
    lora_registry = start_lora_registry((engine_args.served_model_name or [engine_args.model])[0]) if (
        serve_args.allow_runtime_lora_updating) else None
    worker = worker_deployment(
        engine_args,
        kv_scheduler=kv_scheduler,
        num_replicas=serve_args.worker_range.min_replicas,
        autoscaling_config=opts.worker_autoscaling_config(),  # None: a fixed count
        num_cpus=serve_args.worker_num_cpus,
        num_gpus_per_rank=gpus,
        channels=serve_args.ingress_replicas,
        runtime_env=worker_runtime_env(engine_args, serve_args.worker_range.max_replicas, gpus, available_cores(), _job_runtime_env()),
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASSES[serve_args.routing],
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0,
        ),
        # Requests past every replica's max_ongoing_requests wait in each ingress's handle, up to the
        # admission queue's bound; the next gets BackPressureError at once, which the ingress answers
        # with admission control's 429. With kv routing the ingress's own admission queue holds
        # them before they reach the handle; this bound is then a backstop.
        max_queued_requests=serve_args.admission_queue_size or -1,
        graceful_shutdown_timeout_s=serve_args.drain_timeout_s,
    )
    ingress = serve.deployment(
        OpenAIIngress,
        name=INGRESS_DEPLOYMENT_NAME,
        num_replicas=serve_args.ingress_replicas,
        # The ingress only tokenizes and relays; its concurrency is bounded by the workers' queues.
        max_ongoing_requests=4096,
        graceful_shutdown_timeout_s=serve_args.drain_timeout_s,
        ray_actor_options={"num_cpus": serve_args.ingress_num_cpus},
    )
    serving = ServingLimits(serve_args.max_prompts_per_request, serve_args.max_prompt_chars,
                            serve_args.max_request_id_chars, serve_args.max_chat_messages,
                            serve_args.max_unstreamed_response_tokens)
    return ingress.bind(worker, engine_args, api_key=serve_args.key(), kv_scheduler=kv_scheduler,
                        kv_routing=opts.kv_routing(), serving=serving,
                        body_limits=BodyLimits(serve_args.max_request_body_bytes),
                        drain_timeout_s=serve_args.drain_timeout_s,
                        tools=ToolCallOptions(serve_args.tool_call_parser, serve_args.enable_auto_tool_choice),
                        reasoning_parser=serve_args.reasoning_parser,
                        drain_board=drain_board, lora_registry=lora_registry)


def worker_runtime_env(engine_args: EngineArgs, workers: int, gpus_per_rank: float, cores: int,
                       job_env: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The worker replicas' Ray ``runtime_env``: None (they inherit the job's, as any deployment
    without one does), or the job's ``job_env`` with libgomp's spin added to its ``env_vars``
    (``compute_thread_env``) where one CPU engine of one rank (no GPU reserved, not a CUDA
    or simulated engine) computes on as many threads as ``cores``. ``cores`` and the thread count are this
    machine's, where the app is built: on a multi-node cluster they stand for the worker's node.
    The job's whole environment is carried over because Serve gives a deployment the job's
    runtime_env only when it has none of its own. A GOMP_SPINCOUNT or OMP_WAIT_POLICY=ACTIVE of
    the user's (in ``environ`` or the job's env_vars) wins."""
    if gpus_per_rank or engine_args.device == "cuda" or workers != 1 or engine_args.tensor_parallel_size != 1 \
            or engine_args.cpu_omp_threads is None or engine_args.simulate is not None:
        return None
    job_vars = dict(job_env.get("env_vars") or {})
    spin = compute_thread_env(engine_args.cpu_omp_threads, cores, {**environ, **job_vars})
    if not spin:
        return None
    return {**job_env, "env_vars": {**job_vars, **spin}}


def _job_runtime_env() -> dict[str, Any]:
    return dict(ray.get_runtime_context().runtime_env) if ray.is_initialized() else {}


def _cluster_has_gpus() -> bool:
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
