"""The worker as a Ray Serve deployment (Ray is imported in worker/ only here, by the TP ranks'
placement and executor in worker/parallel/, and by the metrics recorder).

``WorkerReplica`` is plain Python around one ``AsyncLLMEngine`` (injectable,
as in Ray Serve LLM); ``worker_deployment`` binds it into a Serve deployment.
The engine's step loop runs in its own thread, so this replica's event loop
stays free for new requests, aborts, health checks and stats. Callers that
run many requests (the ingress) take their deltas on one ``channel`` per
replica rather than on each request's stream, and send requests on that
channel's connection where they can (``worker.replica.wire``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from functools import partial
from typing import Any, AsyncIterator, Callable, Mapping

import ray
from ray import serve
from ray.serve import Application

from pagefleet.worker import tracing
from pagefleet.worker.aio import cancel_and_wait
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.errors import CompileQueueFull, EngineDeadError
from pagefleet.worker.lora.request import LoRAModulePath
from pagefleet.worker.metrics.stats import ReplicaStats
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.replica.autoscaling import KV_TOTAL_METRIC, KV_USED_METRIC, LOAD_METRIC
from pagefleet.worker.replica.delta_channel import LOOPBACK, ChannelServer, DeltaChannel
from pagefleet.worker.replica.kv_publisher import KVEventPublisher
from pagefleet.worker.replica.seats import Seats
from pagefleet.worker.replica.wire import (
    CHANNEL_HOST_ENV,
    Abort,
    ChannelOpen,
    Ended,
    Notice,
    Placed,
    SocketOffer,
    WorkerRequest,
)
from pagefleet.worker.request_check import InvalidRequest

logger = logging.getLogger(__name__)

WORKER_DEPLOYMENT_NAME = "PagefleetWorker"
# How long a replica whose engine died waits before its process exits: the failed streams'
# engine_dead notices reach their ingress first, so each is handled as an engine death.
ENGINE_DEAD_EXIT_DELAY_S = 0.5


def _exit_process() -> None:
    # Ray sees the actor die: Serve's routers drop it at their next call to it and the controller
    # starts another, instead of routing to a dead engine until a health check fails.
    os._exit(1)


def _default_engine(args: EngineArgs):
    from pagefleet.worker.engine.async_engine import AsyncLLMEngine
    from pagefleet.worker.metrics.recorder import RayEngineMetricsRecorder

    def recorder(cfg):
        return RayEngineMetricsRecorder(cfg.served_model_name, _replica_id(), cfg.max_model_len)

    return AsyncLLMEngine(args, metrics=recorder)


class _SchedulerLink:
    """The publisher's calls to the global scheduler actor (``router.global_scheduler.actor``)."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        # Set as the replica leaves the view: a call sent after its drop would put it back.
        self.closed = False

    async def publish(self, batch: KVEventBatch) -> bool:
        if self.closed:
            return False
        return await self._scheduler.publish.remote(batch)

    async def publish_snapshot(self, snapshot: KVSnapshot) -> None:
        if not self.closed:
            await self._scheduler.publish_snapshot.remote(snapshot)


class WorkerReplica:
    """One engine (one TP group) per replica; every method is cheap except ``generate``.

    With a ``kv_scheduler`` (the global scheduler actor's handle), the engine's KV events
    are published to it from this replica's event loop (``KVEventPublisher``)."""

    def __init__(self, engine_args: EngineArgs, engine_factory: Callable[[EngineArgs], Any] = _default_engine,
                 kv_scheduler: Any = None, channel_host: str | None = None,
                 exit_process: Callable[[], None] = _exit_process) -> None:
        tracing.init_tracing(engine_args.otlp_traces_endpoint, "pagefleet-worker")
        self.engine = engine_factory(engine_args)
        self.replica_id = _replica_id()
        self._kv_scheduler = kv_scheduler
        self._exit_process = exit_process
        self.engine.on_dead = self._engine_died
        self.num_requests_total = 0
        # Requests in the engine, through Serve or sent on a channel connection (the
        # deployment's request limit, which Serve enforces only for its own calls).
        self.seats = Seats(engine_args.max_queued_seqs)
        self._channels: dict[str, DeltaChannel] = {}
        # Where channel sockets listen: as given, else $PAGEFLEET_CHANNEL_HOST, else chosen per caller
        # (``_channel_host``).
        self._channel_host = channel_host or os.environ.get(CHANNEL_HOST_ENV) or None
        self._node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self._channel_server = ChannelServer(self._channel, self._drop_if_unused, self._on_commands)
        self._publisher: KVEventPublisher | None = None
        self._link = _SchedulerLink(kv_scheduler)
        if kv_scheduler is not None:
            self._publisher = KVEventPublisher(self._link, self.engine.kv_snapshot)
            self.engine.enable_kv_events(self.replica_id, self._publisher.put, self._publisher.ready)
        cfg = self.engine.model_config
        logger.info("worker replica %s serves %s (max_model_len %d)", self.replica_id, cfg.served_model_name,
                    cfg.max_model_len)

    def _engine_died(self, error: BaseException) -> None:
        """On the step thread, once the engine loop died and its streams were failed: this replica
        leaves the global scheduler's view and then exits, so that no router sends it another
        request while Serve's health check has yet to notice."""
        logger.error("worker replica %s: its engine died (%r); it leaves the KV view and exits", self.replica_id,
                     error)
        self._leave_view()
        time.sleep(ENGINE_DEAD_EXIT_DELAY_S)
        self._exit_process()

    def _leave_view(self) -> None:
        """Drops this replica from the global scheduler's view (so from every ingress's copy) now,
        not after the scheduler's liveness timeout: no ingress ranks it first any more, and its
        blocks stop counting as the fleet's room. Blocks its thread for that call (it is leaving)."""
        if self._kv_scheduler is None or self._link.closed:
            return
        self._link.closed = True  # before the drop: no publish of its own puts it back
        try:
            ray.get(self._kv_scheduler.drop_worker.remote(self.replica_id), timeout=5)
        except Exception as exc:  # noqa: BLE001 — it still leaves, by the liveness timeout
            logger.warning("worker replica %s: the global scheduler did not drop it: %r", self.replica_id, exc)

    def _start_publishing(self) -> None:
        # The publisher's task belongs on the replica's event loop, which only async methods see;
        # Serve calls record_routing_stats every stats period, so it starts within one.
        if self._publisher is not None:
            self._publisher.start()

    async def generate(self, request: WorkerRequest) -> AsyncIterator[RequestOutputDelta | Placed | Ended]:
        """Streams one delta per engine step, or with ``request.channel`` puts them on that channel
        and streams ``Placed`` then ``Ended`` (``wire``; with no reader attached to the
        channel, ``Placed(on_channel=False)`` then the deltas). When the caller cancels (a client
        hung up), Serve cancels this generator and the engine aborts the request and frees its
        blocks."""
        await self.seats.take(request.priority)
        span = self._span(request)
        deltas = pump = error = None
        try:
            self._start_publishing()
            self.num_requests_total += 1
            channel = None if request.channel is None else self._channels.get(request.channel)
            if channel is None or not channel.attached:  # no channel, or nobody reads it yet: this stream
                deltas = self._generate(request, span, None)
                if request.channel is not None:
                    yield Placed(self.replica_id, on_channel=False)
                async for delta in deltas:
                    yield delta
                return
            forwarded = _Count(channel.put)
            deltas = self._generate(request, span, forwarded)
            channel.requests += 1
            # The engine takes the request while Serve sends the Placed, not once it is sent.
            pump = asyncio.ensure_future(_put_on(channel, deltas))  # it closes ``deltas`` when it ends
            try:
                yield Placed(self.replica_id)
                yield Ended(await pump + forwarded.count)
            finally:
                channel.requests -= 1
                self._drop_if_unused(request.channel)
                await cancel_and_wait(pump)  # the caller cancelled, if it still runs: the engine aborts it now
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.seats.free()  # before any await: a second cancellation cannot skip it
            if deltas is not None and pump is None:
                await deltas.aclose()  # at once, not when collected: a cancelled request is aborted now
            tracing.end(span, error)

    def _span(self, request: WorkerRequest) -> Any:
        return tracing.start_span("pagefleet.worker.generate", request.trace_headers, None,
                                  {"pagefleet.request_id": request.request_id, "pagefleet.replica": self.replica_id})

    def _on_commands(self, channel_id: str, commands: list[WorkerRequest | Abort],
                     running: dict[str, asyncio.Task]) -> None:
        """Requests and aborts sent on a channel connection (``ChannelServer``); ``running``: that
        connection's requests, cancelled when it ends. A request that finds no free seat is refused
        at once (the caller sends it through Serve: Serve's queue, then a seat here)."""
        channel = self._channel(channel_id)
        for command in commands:
            if isinstance(command, Abort):
                task = running.get(command.request_id)
                if task is not None:
                    task.cancel()
            elif command.request_id in running:  # the caller sends each id once; one of ours never repeats
                channel.put(Notice(command.request_id, "invalid", f"request id {command.request_id!r} is already running"))
            elif not self.seats.try_take():
                channel.put(Notice(command.request_id, "refused"))
            else:
                channel.requests += 1
                task = asyncio.ensure_future(self._run_sent(command, channel))
                running[command.request_id] = task
                task.add_done_callback(partial(self._sent_ended, channel_id, channel, command.request_id, running))

    async def _run_sent(self, request: WorkerRequest, channel: DeltaChannel) -> None:
        span = self._span(request)
        error = None
        try:
            self._start_publishing()
            self.num_requests_total += 1
            await _put_on(channel, self._generate(request, span, channel.put))
        except Exception as exc:  # noqa: BLE001 — the caller makes it the client's error
            error = exc
            channel.put(_notice(request.request_id, exc))
        except BaseException as exc:  # cancelled: the connection ended or the caller aborted it
            error = exc
            raise
        finally:
            tracing.end(span, error)

    def _sent_ended(self, channel_id: str, channel: DeltaChannel, request_id: str,
                    running: dict[str, asyncio.Task], task: asyncio.Task) -> None:
        """Here, not in ``_run_sent``: a task cancelled before it ran never runs its ``finally``."""
        if running.get(request_id) is task:
            del running[request_id]
        self.seats.free()
        channel.requests -= 1
        self._drop_if_unused(channel_id)

    def _generate(self, request: WorkerRequest, span: Any,
                  forward: Callable[[RequestOutputDelta], None] | None) -> AsyncIterator[RequestOutputDelta]:
        """The engine's stream of ``request``. With ``forward`` the engine may hand deltas to it as
        they come rather than yield them (``AsyncLLMEngine.generate``); an engine that yields every
        delta is as right, only dearer."""
        return self.engine.generate(request.request_id, request.prompt_token_ids, request.params, request.extra_keys,
                                    request.block_hashes, span=span, resume=request.resume, forward=forward,
                                    client=request.client, priority=request.priority,
                                    lora_name=request.lora_name, lora_path=request.lora_path)

    async def load_lora(self, module: LoRAModulePath) -> None:
        """Read, check and register a LoRA adapter in this replica's engine (``/v1/load_lora_adapter``
        asks one replica; the others register it from the path each request for it carries). A
        ValueError (``LoRAAdapterError``) says what is wrong with it."""
        await self.engine.load_lora(module.name, module.path)

    async def channel(self, request: ChannelOpen) -> AsyncIterator[bytes | SocketOffer]:
        """A caller's delta channel (``worker.replica.wire``): an encoded empty list once attached,
        then every delta of its requests, one encoded list per wake-up; with ``request.socket``,
        only a ``SocketOffer`` (the connection that claims it gets the same, and may send its
        requests on it), unless this replica cannot listen; the call then lasts until that
        connection ends, so that Serve's graceful shutdown waits for the requests on it. Refuses a
        call meant for another replica (the request routers send it to ``request.replica_id`` alone)."""
        if request.replica_id != self.replica_id:
            raise ValueError(f"channel {request.channel_id} is for replica {request.replica_id}, "
                             f"not {self.replica_id}")
        if request.socket:
            host = self._channel_host_for(request.node_id)
            try:
                offer, offered = await self._channel_server.offer(request.channel_id, host)
            except OSError as exc:  # cannot listen there: this stream is the channel
                logger.warning("delta channel socket unavailable on %s (%s); serving channel %s on its Serve "
                               "stream", host, exc, request.channel_id)
            else:
                yield offer
                await offered.until_done()
                return
        batches = self._channel(request.channel_id).batches()
        try:
            async for batch in batches:
                yield batch
        finally:
            await batches.aclose()  # detaches now, not when collected
            self._drop_if_unused(request.channel_id)

    def _channel_host_for(self, caller_node_id: str | None) -> str:
        """Loopback for a caller on this replica's node (no other machine can reach that socket),
        the node's address for one elsewhere (the cluster spans nodes), unless the address is set."""
        if self._channel_host is not None:
            return self._channel_host
        if caller_node_id is not None and caller_node_id == self._node_id:
            return LOOPBACK
        return _node_ip()

    def _channel(self, channel_id: str) -> DeltaChannel:
        return self._channels.setdefault(channel_id, DeltaChannel())

    def _drop_if_unused(self, channel_id: str) -> None:
        channel = self._channels.get(channel_id)
        if channel is not None and channel.unused:
            del self._channels[channel_id]

    async def kv_snapshot(self) -> KVSnapshot:
        """Everything this replica's prefix cache holds, with the KV event number it is valid at."""
        return await self.engine.kv_snapshot()

    async def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    async def check_health(self) -> None:
        """Serve's health probe (raising marks this replica unhealthy and Serve replaces it), also
        routed like a request by the ingress's /health. The engine raises when its loop died or it
        has work but stopped stepping."""
        self._start_publishing()
        self.engine.check_health()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Published to the request router every stats period (see ``request_router_config``)."""
        self._start_publishing()
        return self.stats().to_routing_stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics, read every record period when the deployment has
        an ``autoscaling_config``: this replica's requests, through Serve or sent on a channel
        connection (``worker.replica.autoscaling``; Serve's own count misses the latter), and the KV
        blocks its running sequences hold, of all (what ``kv_room_policy`` scales on)."""
        engine = self.engine.stats()
        return {LOAD_METRIC: float(self.seats.demand),
                KV_USED_METRIC: float(engine.num_total_blocks - engine.num_free_blocks),
                KV_TOTAL_METRIC: float(engine.num_total_blocks)}

    def stats(self) -> ReplicaStats:
        try:
            self.engine.check_health()
            healthy = True
        except Exception:
            healthy = False
        return ReplicaStats(replica_id=self.replica_id, healthy=healthy,
                            num_requests_total=self.num_requests_total, engine=self.engine.stats())

    def __del__(self) -> None:
        """Serve calls it once its graceful shutdown drained this replica (Serve scaled it down, or
        replaces it), unless ``graceful_shutdown_timeout_s`` ran out first."""
        server = getattr(self, "_channel_server", None)
        if server is not None:
            server.close()
        if getattr(self, "_link", None) is not None:
            self._leave_view()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class _Count:
    """``fn`` (a channel's ``put``), counting its calls: the engine hands most of a request's deltas
    to it directly (``AsyncLLMEngine.generate``'s ``forward``)."""

    __slots__ = ("fn", "count")

    def __init__(self, fn: Callable[[RequestOutputDelta], None]) -> None:
        self.fn = fn
        self.count = 0

    def __call__(self, delta: RequestOutputDelta) -> None:
        self.fn(delta)
        self.count += 1


async def _put_on(channel: DeltaChannel, deltas: AsyncIterator[RequestOutputDelta]) -> int:
    """Puts a request's deltas on its channel; how many it put."""
    sent = 0
    try:
        async for delta in deltas:
            channel.put(delta)
            sent += 1
    finally:
        await deltas.aclose()  # at once, not when collected: a cancelled request is aborted now
    return sent


def _notice(request_id: str, exc: Exception) -> Notice:
    """A request's failure as the caller turns it back into an exception (``delta_mux``)."""
    if isinstance(exc, InvalidRequest):
        return Notice(request_id, "invalid", str(exc.args[0]) if exc.args else "invalid request", exc.param, exc.code)
    if isinstance(exc, EngineDeadError):
        return Notice(request_id, "engine_dead", str(exc))
    if isinstance(exc, CompileQueueFull):
        return Notice(request_id, "busy", str(exc))
    return Notice(request_id, "error", f"{type(exc).__name__}: {exc}")


def _node_ip() -> str:
    """The node's address, where Ray's own workers listen (loopback outside a Ray worker: tests
    that build the class directly)."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests that build the class directly)
        return "local"


def worker_deployment_options(engine_args: EngineArgs, *, num_replicas: int = 1, num_cpus: float = 1.0,
                              num_gpus_per_rank: float = 0.0, name: str = WORKER_DEPLOYMENT_NAME,
                              channels: int = 1, runtime_env: Mapping[str, Any] | None = None,
                              autoscaling_config: Mapping[str, Any] | None = None,
                              **deployment_options: Any) -> dict[str, Any]:
    """``serve.deployment`` options for ``num_replicas`` engines of ``engine_args``, or for as many
    as ``autoscaling_config`` (``worker.replica.autoscaling``) asks, whose ``channels`` callers
    (the ingress replicas) each hold one delta channel on every replica; ``runtime_env``: each
    replica's Ray runtime_env (None: the job's, as Serve gives it).

    A tensor-parallel engine gets a placement group of one bundle per rank,
    STRICT_PACK so its ranks share a node (all-reduce stays on NVLink or
    loopback): bundle 0 holds the replica itself (rank 0), bundles 1..N-1 the
    rank actors the engine starts. ``deployment_options`` (request router
    config, health periods, ...) override or extend these.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if channels < 0:
        raise ValueError(f"channels must be >= 0, got {channels}")
    if num_cpus < 0 or num_gpus_per_rank < 0:
        raise ValueError("num_cpus and num_gpus_per_rank must be >= 0")
    # A simulated engine is one process whatever its size: it starts no rank actors.
    tp = 1 if engine_args.simulate is not None else engine_args.tensor_parallel_size
    options: dict[str, Any] = {
        "name": name,
        # Serve takes one or the other.
        **({"autoscaling_config": dict(autoscaling_config)} if autoscaling_config is not None
           else {"num_replicas": num_replicas}),
        # Requests beyond this wait in Serve's router queue, where they can still go to another
        # replica, rather than in one engine's waiting queue. Each caller's delta channel is a
        # call that lasts: it gets a place of its own, not a request's.
        "max_ongoing_requests": engine_args.max_queued_seqs + channels,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus_per_rank},
    }
    if runtime_env is not None:
        options["ray_actor_options"]["runtime_env"] = dict(runtime_env)
    if tp > 1:
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus_per_rank} if num_gpus_per_rank else {})}
        options["placement_group_bundles"] = [dict(bundle) for _ in range(tp)]
        options["placement_group_strategy"] = "STRICT_PACK"
    # A caller's ray_actor_options add to these (or override one key) rather than replace them.
    options["ray_actor_options"].update(deployment_options.pop("ray_actor_options", {}))
    options.update(deployment_options)
    return options


def worker_deployment(engine_args: EngineArgs, *, engine_factory: Callable[[EngineArgs], Any] | None = None,
                      kv_scheduler: Any = None, **options: Any) -> Application:
    """Bind ``WorkerReplica`` into a Serve deployment (options: ``worker_deployment_options``);
    ``kv_scheduler``: the global scheduler actor the replicas publish KV events to."""
    deployment = serve.deployment(WorkerReplica, **worker_deployment_options(engine_args, **options))
    return deployment.bind(engine_args, engine_factory or _default_engine, kv_scheduler)
