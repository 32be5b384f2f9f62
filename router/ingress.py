"""The Serve ingress deployment: the OpenAI FastAPI app in front of the worker deployment.

The ingress loads the tokenizer and config.json only (no weights): it
tokenizes, applies chat templates, validates and hashes prompt blocks, so bad
requests stop here. With ``kv`` routing it decides where each request goes
with its own copy of the global scheduler's view (``KVRoutingClient`` over a
``SchedulerMirror``, which a ``ViewFollower`` task keeps current from the
scheduler actor's feed, off the requests' path) and hands the ranking to the
request router inside the ``WorkerRequest``. Requests go to workers through a Serve
handle; their deltas come back on this ingress's delta channel to that replica
(one TCP connection per replica, or a Serve stream where it cannot connect, carrying every
request's deltas of a step: ``router.worker_client.delta_mux``), their errors on their own
stream. Closing a request's stream cancels the handle's response, which cancels the worker-side
generator, which aborts the request in the engine. A request whose ranking puts first a replica
that this ingress's channel to is an open connection goes on that connection instead (Serve's
handle call is the largest hop before the engine); if the replica refuses it (full), through
Serve after all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import weakref
from typing import Any, AsyncIterator, NamedTuple

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from pagefleet.router.global_scheduler.actor import WorkerKVView, worker_kv_view
from pagefleet.router.global_scheduler.kv_mirror import MirrorCounters, SchedulerMirror, ViewFollower
from pagefleet.router.global_scheduler.views import SchedulerCounters
from pagefleet.router.lora_registry import ActorRegistryLink
from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.openai.app import build_openai_app, freeze_loaded_objects
from pagefleet.router.openai.http_guards import BodyLimits
from pagefleet.router.openai.lora_adapters import RuntimeLoRAs
from pagefleet.router.openai.node_metrics import NodeMetricsReader
from pagefleet.router.openai.output.reasoning import PARSERS as REASONING_PARSERS
from pagefleet.router.openai.preprocess import ModelInfo, ServingLimits, longest_token_chars
from pagefleet.router.openai.service import Job, OpenAIService
from pagefleet.router.openai.tool_choice import ToolCallOptions
from pagefleet.router.routing.admission import AdmissionCounters
from pagefleet.router.routing.kv_routing import KVRoutingClient, KVRoutingOptions, RoutingCounters
from pagefleet.router.routing.request_router import routable
from pagefleet.router.worker_client.delta_mux import (
    ChannelLost,
    ChannelMux,
    MuxCounters,
    ReplicaBusy,
    read_deltas,
    watch,
)
from pagefleet.router.worker_client.failover import StreamProgress
from pagefleet.router.worker_client.worker_errors import WorkerHealth, engine_died, worker_failure
from pagefleet.worker import tracing
from pagefleet.worker.aio import merge_streams
from pagefleet.worker.core.kv_cache_sizing import max_blocks_per_seq, step_tokens
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.lora.request import LoRAModulePath
from pagefleet.worker.model_executor.model_config import model_config_of
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.replica.wire import Placed, WorkerRequest
from pagefleet.worker.request_check import RequestLimits

logger = logging.getLogger(__name__)

INGRESS_DEPLOYMENT_NAME = "OpenAIIngress"
# A request that has produced nothing yet is tried again on another replica when its worker dies
# (or is unreachable) before answering: nothing was sent, so nothing is repeated.
MAX_ATTEMPTS = 3
# Times one request's sequences may move to another replica after output started.
MAX_FAILOVERS = 2
# Engines that may die while running one request before it is taken for the cause and not sent
# again: the requests in flight when an engine dies go on elsewhere once; one that an engine dies
# under a second time ends with the error, so that no request takes down replica after replica.
MAX_ENGINE_DEATHS = 1


class ReplicaInFlight(NamedTuple):
    """An ingress replica and how many requests it still had in flight when its ``drain`` ended."""

    replica_id: str
    num_in_flight: int


@dataclasses.dataclass(frozen=True)
class IngressCounters:
    """One ingress replica's answer to ``OpenAIIngress.counters``: what its routing, delta
    channels, copy of the scheduler's view and admission have counted. A Serve handle call
    reaches one replica, so a caller that needs every replica calls until each has answered."""

    replica_id: str
    channel: MuxCounters
    routing: RoutingCounters | None = None     # None without kv routing, as the rest below
    mirror: MirrorCounters | None = None       # the copy's polls and resyncs
    view: SchedulerCounters | None = None      # the copy's decisions and predictions
    admission: AdmissionCounters | None = None
    worker_view: WorkerKVView | None = None    # the copy's view of the worker asked about


# How often a draining replica tells the drain board how many requests it still has in flight.
DRAIN_REPORT_PERIOD_S = 0.1


async def follow_drain(board: Any, service: OpenAIService, replica_id: str,
                       period_s: float = DRAIN_REPORT_PERIOD_S) -> None:
    """Waits for ``pagefleet serve``'s drain board (``cluster.drain.DrainBoard``) to say drain,
    then stops admitting and reports this replica's requests in flight until none are left. A
    Serve handle sends a call to one replica; every replica follows the board, so a drain reaches
    them all. Ends quietly when the board is gone (the command that made it exited)."""
    try:
        await board.wait_for_drain.remote()
        num = service.stop_admitting()
        while True:
            await board.report.remote(replica_id, num)
            if num == 0:
                return
            await asyncio.sleep(period_s)
            num = service.num_in_flight
    except RayActorError:
        return


class ActorFeedLink:
    """``kv_mirror.FeedLink`` over the global scheduler actor's handle."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    async def updates(self, epoch: str | None, cursor: int, wait_s: float):
        return await self.scheduler.updates.remote(epoch, cursor, wait_s)


class HandleWorkerClient:
    """``WorkerClient`` over a Serve handle to the worker deployment (and, with ``kv`` routing,
    a ``KVRoutingClient`` deciding with this ingress's copy of the scheduler's view)."""

    def __init__(self, handle: DeploymentHandle, kv: KVRoutingClient | None = None,
                 health: WorkerHealth | None = None, metrics: RouterMetrics | None = None,
                 follower: ViewFollower | None = None) -> None:
        self._handle = handle
        self._stream = handle.options(method_name="generate", stream=True)
        self._deployment = (handle.app_name, handle.deployment_name)
        self.metrics = metrics or RouterMetrics()
        self.metrics.start_at_zero("delta_channels_opened", {"transport": "socket"}, {"transport": "serve_stream"})
        self.metrics.start_at_zero("failovers", {"reason": "worker_failed"})
        self.metrics.start_at_zero("worker_resends", {"reason": "worker_failed"}, {"reason": "connection_lost"})
        self.metrics.start_at_zero("delta_channel_socket_failures", {"reason": "connect"}, {"reason": "dropped"})
        self.mux = ChannelMux(handle.options(method_name="channel", stream=True).remote,
                              on_opened=lambda transport: self.metrics.inc("delta_channels_opened",
                                                                           transport=transport),
                              on_socket_unusable=lambda reason: self.metrics.inc("delta_channel_socket_failures",
                                                                                 reason=reason),
                              node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else None)
        self._watchers: set[asyncio.Task] = set()
        self._health = health or WorkerHealth(handle.deployment_name)
        self.kv = kv
        self.follower = follower

    def check_room(self) -> None:
        if self.kv is not None:
            self.kv.check_room()

    async def route(self, job: Job) -> list[str] | None:
        if self.kv is None:
            return None
        if self.follower is not None:
            self.follower.start()  # a no-op once running (started by the constructor where it can)
        decision = await self.kv.route(job.request_id, job.block_hashes, len(job.token_ids), job.params.max_tokens,
                                       job.params.n, job.priority)
        if decision is None:
            return None
        # The blocks this request may hold count in the ingress's own load until its stream ends
        # (``generate``) or, if it is never sent (refused later, failed), until the job is gone.
        weakref.finalize(job, self.kv.ended_later, job.request_id)
        return decision.ranking

    async def generate(self, job: Job) -> AsyncIterator[RequestOutputDelta]:
        done = False
        try:
            async for delta in self._attempts(job):
                yield delta
            done = True
        finally:
            if self.kv is not None:  # its blocks and its slot leave this ingress's count now
                self.kv.finished(job.request_id, cut_short=not done)

    async def _attempts(self, job: Job) -> AsyncIterator[RequestOutputDelta]:
        request = WorkerRequest(job.request_id, job.token_ids, job.params, job.block_hashes, job.extra_keys,
                                job.ranking, channel=self.mux.channel_id, trace_headers=tracing.headers_of(job.span),
                                client=job.client, priority=job.priority, lora_name=job.lora_name,
                                lora_path=job.lora_path)
        async for delta in self._follow(job, request, StreamProgress(job.params.n), failovers=0):
            yield delta

    async def _follow(self, job: Job, request: WorkerRequest, progress: "StreamProgress",
                      failovers: int) -> AsyncIterator[RequestOutputDelta]:
        """One worker request's deltas. Sent again while none came; when its replica fails after
        some came, each unfinished sequence goes on on another replica from what it had generated
        (``ResumeState``), so the client's stream continues without a seam."""
        base_id = request.request_id
        q = self.mux.register(base_id)  # before sending: its deltas may arrive before its Placed
        attempt, sends, on_connection, again = 1, 1, True, False
        try:
            while True:
                if again:
                    # Sent again under an id of its own: the replica the last send ran on may hold
                    # that id until its abort lands between two steps, and anything that send still
                    # puts on its way goes to no queue.
                    self.mux.release(request.request_id)
                    sends += 1
                    request.request_id = f"{base_id}#{sends}"
                    q = self.mux.register(request.request_id)
                    again = False
                response = None
                started = finished = False
                try:
                    tracing.event(job.span, "sent")
                    deltas = self._sent(request, q) if on_connection else None
                    if deltas is None:
                        response = self._stream.remote(request)  # may refuse at once: Serve's queue is full
                        deltas = await self._placed(request.request_id, response, q)
                    async for delta in deltas:
                        if not started and self.kv is not None and failovers == 0:
                            self.kv.record_realised(delta.num_cached_tokens)
                        started = True
                        finished = delta.finished
                        progress.add(delta)
                        yield delta
                    return
                except ReplicaBusy:  # refused on the connection, nothing ran: through Serve, which queues it
                    on_connection = False
                except Exception as exc:  # noqa: BLE001 — each becomes an OpenAI error (or a retry) below
                    again = True
                    if isinstance(exc, ChannelLost) and not started:
                        # The connection it was sent on ended before any of its output came: the
                        # replica closes a channel idle for a few seconds and a request sent just then
                        # goes with it, or the replica went away. Nothing reached the client and the
                        # replica aborts whatever of it ran, so it goes through Serve as a refused one
                        # does, with its ranking and without spending an attempt (a failure there would).
                        # Its output comes back on that call too: the replica may not have seen the
                        # connection end yet, and would put the output on it, where nobody reads.
                        on_connection, request.channel = False, None
                        self.metrics.inc("worker_resends", reason="connection_lost")
                        continue
                    error, retry = worker_failure(exc)
                    if retry and engine_died(exc):
                        progress.engine_deaths += 1
                        retry = progress.engine_deaths <= MAX_ENGINE_DEATHS
                    if error.status_code == 429:
                        self.metrics.inc("admission_rejections", reason="worker_queue_full")
                    if retry and started and failovers < MAX_FAILOVERS:
                        break  # failed over below, once this send's queue is released
                    if not retry or started or attempt == MAX_ATTEMPTS:
                        raise error from None
                    attempt += 1
                    logger.warning("request %s: worker unavailable before its first output (%s); attempt %d of %d",
                                   job.request_id, type(exc).__name__, attempt, MAX_ATTEMPTS)
                    request.ranking = None  # its first choice failed: the request router picks again
                    self.metrics.inc("worker_resends", reason="worker_failed")
                finally:
                    if not finished:
                        self.mux.abort(request.request_id)  # sent on a connection and still running there
                        if response is not None:
                            with contextlib.suppress(Exception):  # a refused or failed call re-raises on cancel
                                response.cancel()
        finally:
            self.mux.release(request.request_id)
        logger.warning("request %s: its worker replica failed mid-stream; %d sequence(s) go on elsewhere",
                       job.request_id, len(progress.unfinished()))
        self.metrics.inc("failovers", reason="worker_failed")
        resumed = [dataclasses.replace(request, request_id=f"{job.request_id}~{failovers + 1}.{index}",
                                       params=dataclasses.replace(job.params, n=1),
                                       ranking=None, resume=state)
                   for index, state in progress.unfinished()]
        follows = [self._follow(job, r, progress, failovers + 1) for r in resumed]
        async for delta in merge_streams(follows):
            yield delta

    def _sent(self, request: WorkerRequest, q: asyncio.Queue) -> AsyncIterator[RequestOutputDelta] | None:
        """The request's deltas (``ReplicaBusy`` first if the replica refuses it) once sent on the
        channel connection of its first-ranked replica; None when it has no ranking, that replica
        no open connection, or Serve no longer routes there (one it is stopping): it goes through
        Serve."""
        replica_id = request.ranking[0] if request.ranking else None
        if replica_id is None or not routable(*self._deployment, replica_id) or not self.mux.send(request, replica_id):
            return None
        return read_deltas(q)

    async def _placed(self, request_id: str, response: Any, q: asyncio.Queue) -> AsyncIterator[RequestOutputDelta]:
        """Where a sent request's deltas come from, once its ``Placed`` says: its queue, fed by the
        replica's channel (and by ``watch`` with its ``Ended`` or error), or its own stream."""
        placed = await response.__anext__()
        if isinstance(placed, RequestOutputDelta):  # sent with no channel: its deltas are this stream
            return _prepended(placed, response)
        if not isinstance(placed, Placed):
            raise TypeError(f"a worker answered {type(placed).__name__}, not Placed")
        self.mux.placed(request_id, placed.replica_id)  # its channel is opened if need be
        if not placed.on_channel:  # no channel was attached there yet: the deltas follow on this stream
            return response
        watcher = asyncio.ensure_future(watch(response, q))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return read_deltas(q)

    async def check_health(self) -> None:
        await self._health.check()

    async def load_lora(self, module: LoRAModulePath) -> None:
        """Has one worker replica read, check and register the adapter (its ValueError: why not)."""
        await self._handle.options(method_name="load_lora", stream=False).remote(module)


def load_model_info(args: EngineArgs, serving: ServingLimits = ServingLimits()) -> tuple[Any, ModelInfo]:
    """The tokenizer and ``ModelInfo`` from the checkpoint's config and tokenizer files,
    read exactly as the engine reads them (same max_model_len, same name, same limits)."""
    from transformers import AutoTokenizer

    cfg = model_config_of(args)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.path), trust_remote_code=False)
    if serving.max_prompt_chars is None:
        serving = dataclasses.replace(serving, max_prompt_chars=cfg.max_model_len * longest_token_chars(tokenizer))
    held = max_blocks_per_seq(cfg.max_model_len, args.block_size, cfg.kv_sliding_window,
                              step_tokens(args.max_num_batched_tokens, args.num_scheduler_steps))
    return tokenizer, ModelInfo(served_model_name=cfg.served_model_name, limits=RequestLimits.of(cfg, args),
                                serving=serving, block_size=args.block_size,
                                more_names=cfg.served_model_names[1:], path_names=cfg.model_path_names,
                                max_blocks_per_seq=held,
                                lora_modules=tuple(args.lora_modules or ()) if args.enable_lora else ())


@serve.ingress()
class OpenAIIngress:
    def __init__(self, worker: DeploymentHandle, engine_args: EngineArgs, *, api_key: str | None = None,
                 kv_scheduler: Any = None, kv_routing: KVRoutingOptions | None = None,
                 serving: ServingLimits = ServingLimits(), body_limits: BodyLimits = BodyLimits(),
                 drain_timeout_s: float = 30.0, tools: ToolCallOptions = ToolCallOptions(),
                 reasoning_parser: str | None = None, drain_board: Any = None, lora_registry: Any = None) -> None:
        """``kv_scheduler``: the global scheduler actor, for ``kv`` routing (None: other policies).
        ``drain_board``: the actor through which ``pagefleet serve`` drains every ingress replica
        (``follow_drain``; None: an app deployed otherwise, drained one replica at a time with
        ``drain``). ``lora_registry``: the runtime LoRA registry actor (``router.lora_registry``;
        None: /v1/load_lora_adapter and /v1/unload_lora_adapter do not exist)."""
        tracing.init_tracing(engine_args.otlp_traces_endpoint, "pagefleet-ingress")
        tokenizer, info = load_model_info(engine_args, serving)
        self._metrics = RouterMetrics(default_tags={"model_name": info.served_model_name})
        kv = follower = self._mirror = None
        if kv_scheduler is not None:
            kv_routing = kv_routing or KVRoutingOptions()
            self._mirror = SchedulerMirror(kv_routing.cost_weight, max_seqs_per_worker=engine_args.max_queued_seqs)
            follower = ViewFollower(ActorFeedLink(kv_scheduler), self._mirror)
            kv = KVRoutingClient(self._mirror, kv_routing, engine_args.block_size, self._metrics,
                                 max_blocks_per_seq=info.max_blocks_per_seq)
            with contextlib.suppress(RuntimeError):  # Serve runs constructors on the replica's loop
                asyncio.get_running_loop()
                follower.start()
        self._client = HandleWorkerClient(worker, kv, metrics=self._metrics, follower=follower)
        self._service = OpenAIService(tokenizer=tokenizer, info=info, client=self._client, tools=tools,
                                      reasoning=REASONING_PARSERS[reasoning_parser] if reasoning_parser else None)
        self._loras = None if lora_registry is None else RuntimeLoRAs(
            ActorRegistryLink(lora_registry), self._service.runtime_loras, self._client.load_lora).start()
        self._api_key = api_key
        self._body_limits = body_limits
        self._drain_timeout_s = drain_timeout_s
        self._drain_follower = None
        if drain_board is not None:
            with contextlib.suppress(RuntimeError):  # the replica's loop, as above
                self._drain_follower = asyncio.get_running_loop().create_task(
                    follow_drain(drain_board, self._service, _replica_id()))
        logger.info("ingress serves %s (max_model_len %d)", info.served_model_name, info.limits.max_model_len)

    def __serve_build_asgi_app__(self):
        app = build_openai_app(self._service, api_key=self._api_key, body_limits=self._body_limits,
                               metrics=self._metrics, node_metrics=NodeMetricsReader(), runtime_loras=self._loras)
        freeze_loaded_objects()
        return app

    async def drain(self) -> ReplicaInFlight:
        """Graceful shutdown: new requests get 503 from now on; waits up to drain_timeout_s for
        the in-flight ones. Returns this replica's id and how many were still running."""
        left = await self._service.drain(self._drain_timeout_s)
        return ReplicaInFlight(_replica_id(), left)

    async def counters(self, worker_id: str | None = None) -> IngressCounters:
        """This replica's counters (Serve handle call, for operators' scripts, benchmarks and
        tests; the HTTP app exports the same events as Prometheus metrics), with its copy's view
        of ``worker_id`` when one is named."""
        kv, mirror = self._client.kv, self._mirror
        if kv is None or mirror is None:
            return IngressCounters(_replica_id(), self._client.mux.counters)
        return IngressCounters(
            _replica_id(), self._client.mux.counters, routing=kv.counters, mirror=mirror.counters,
            view=mirror.core.counters, admission=None if kv.admission is None else kv.admission.counters,
            worker_view=None if worker_id is None else worker_kv_view(mirror.core, worker_id))


async def _prepended(first: RequestOutputDelta, rest: Any) -> AsyncIterator[RequestOutputDelta]:
    yield first
    async for delta in rest:
        yield delta


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id
