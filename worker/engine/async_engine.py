"""The engine behind a server: its step loop runs in its own thread, so the caller's event
loop stays free for new requests, aborts and health checks. Each request streams
``RequestOutputDelta`` chunks, at most one per engine step."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from functools import partial
from typing import AsyncIterator, Callable

from pagefleet.worker import tracing
from pagefleet.worker.core.kv_events import KVEventBatch, KVSnapshot
from pagefleet.worker.core.resume import ResumeState
from pagefleet.worker.engine.handoff import (
    AbortRequest,
    AddRequest,
    EnableKVEvents,
    EngineCall,
    Forwarding,
    HeldDeltas,
    TakeKVSnapshot,
    put_all,
    resolve,
)
from pagefleet.worker.engine.llm_engine import LLMEngine, resolve_device
from pagefleet.worker.engine.resumed import resumed_start
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.errors import EngineDeadError
from pagefleet.worker.lora.request import LoRARequest
from pagefleet.worker.metrics.engine_metrics import EngineMetrics, MetricsRecorder
from pagefleet.worker.metrics.stats import EngineStats
from pagefleet.worker.model_executor.model_config import ModelConfig
from pagefleet.worker.model_executor.platform import platform_of
from pagefleet.worker.outputs import RequestOutputDelta, merge_deltas
from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


__all__ = ["AsyncLLMEngine", "EngineDeadError"]


STEP_TIMEOUT_ENV = "PAGEFLEET_STEP_TIMEOUT_S"
DEFAULT_STEP_TIMEOUT_S = 1800.0


class AsyncLLMEngine:
    """Health is forward progress: the loop is alive, and with work pending it either finished a
    step with output within ``stall_timeout_s`` or is inside a step that began less than
    ``step_timeout_s`` ago. One slow step (a cold compile, a large model on CPU) is progress in
    flight, not a stall; a step that never returns is caught by ``step_timeout_s``
    (``$PAGEFLEET_STEP_TIMEOUT_S``, default 30 min)."""

    def __init__(self, args: EngineArgs, stall_timeout_s: float = 60.0,
                 metrics: Callable[[ModelConfig], MetricsRecorder] | None = None,
                 step_timeout_s: float | None = None) -> None:
        """``metrics`` makes the recorder for this engine's metrics (None: none recorded).

        The engine is built on its own step thread (``_build_and_run``), after the platform made it
        the step thread (``prepare_step_thread``): on CPU, one thread then starts every OpenMP
        parallel region in this process (see ``worker/cpu/threads.prepare_engine_thread``)."""
        self.stall_timeout_s = stall_timeout_s
        self.step_timeout_s = step_timeout_s or float(os.environ.get(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S))
        self._step_started: float | None = None  # monotonic start of the step running now
        self._last_step_started = 0.0  # and of the one before it, whose deltas come early (async output)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # request id -> [its span, whether its first token was marked], for traced requests only
        self._spans: dict[str, list] = {}
        self._held = HeldDeltas(args.stream_interval)  # engine thread only
        self._error: BaseException | None = None
        # Called once, on the step thread, when the step loop dies (after its open streams were
        # failed): the replica leaves routing at once (``WorkerReplica``). None: nothing more.
        self.on_dead: Callable[[BaseException], None] | None = None
        self._kv_sink: Callable[[KVEventBatch], None] | None = None
        self._kv_ready: Callable[[], bool] = lambda: True
        self._stopped = False
        self.pinned_threads: dict[int, int] = {}  # engine thread and OpenMP team -> core (CPU engines)
        self._built = threading.Event()  # the step thread built the engine (or failed to)
        self._started = threading.Event()  # this constructor is done: the step loop may run
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._build_and_run, args=(args,), name="pagefleet-engine",
                                        daemon=True)
        self._thread.start()
        try:
            self._built.wait()
            if self._build_error is not None:
                raise self._build_error
            self.tokenizer = self.engine.tokenizer
            self.model_config = self.engine.model_config
            self._stats = self.engine.stats()
            self._metrics = EngineMetrics(self._stats, time.monotonic(),
                                          recorder=metrics(self.model_config) if metrics is not None else None,
                                          log_interval_s=args.log_stats_interval)
            self._last_progress = time.monotonic()
        except BaseException:  # an interrupt, or a set-up that failed after the build
            self._stopped = True  # the step thread shuts the engine down (once built) and ends
            raise
        finally:
            self._started.set()

    # ---- caller side (any event loop) -------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       extra_keys: tuple = (), block_hashes: bytes = b"",
                       span=None, resume: ResumeState | None = None,
                       forward: Callable[[RequestOutputDelta], None] | None = None,
                       client: str = "", priority: int = 0,
                       lora_name: str | None = None, lora_path: str | None = None
                       ) -> AsyncIterator[RequestOutputDelta]:
        """Stream a request's deltas. Bad input raises ValueError before anything is queued;
        if the consumer stops early the request is aborted and its blocks freed. ``span``: the
        request's tracing span, which the engine thread marks when it takes the request in and
        when its first and last tokens come (``worker.tracing``). ``resume``: continue the one
        sequence another replica had generated this far (``LLMEngine.add_request``).

        ``forward``: called on this loop with each delta but the last as it comes, which the
        stream then does not yield (it yields the last, or raises): a worker replica puts them
        on its delta channel with no task waking per delta. ``client``: who sent it, for the
        per-client bound of the grammar compile queue. ``priority``: vLLM's (``LLMEngine.add_request``).
        ``lora_name``: a registered LoRA adapter's name (``LLMEngine.lora_named``; None: the base model);
        with ``lora_path``, one this engine lacks is registered from there first (``load_lora``)."""
        self._raise_if_dead()
        self.engine.check(prompt_token_ids, params, block_hashes, resume, priority)  # the engine thread does not check again
        lora_request = None
        if lora_name is not None:
            lora_request = await self._lora_for(lora_name, lora_path)
        grammar = resumed = None
        if params.structured_outputs is not None:  # on the engine's compile pool: not here, not the step thread
            grammar = await self.engine.grammars.compile_async(params.structured_outputs, client)
        if resume is not None:  # the replay takes a few decodes a token: on a thread, not this loop
            resumed = await asyncio.to_thread(resumed_start, self.engine.tokenizer, prompt_token_ids, params,
                                              resume, grammar)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        q: asyncio.Queue = asyncio.Queue() if forward is None else Forwarding(forward)
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        if span is not None:
            self._spans[request_id] = [span, False]
        try:
            self._raise_if_dead()  # the loop may have died while this stream was being registered
        except EngineDeadError:
            self._streams.pop(request_id, None)
            self._spans.pop(request_id, None)
            raise
        self._send(AddRequest(request_id, list(prompt_token_ids), params, extra_keys, block_hashes, grammar,
                              resumed, priority, lora_request))
        finished = False
        try:
            while not finished:
                # Everything queued since the last read goes out as one delta: a consumer slower
                # than the engine gets one chunk per read, not a backlog of one per step.
                items = [await q.get()]
                while not q.empty():
                    items.append(q.get_nowait())
                error = next((i for i in items if isinstance(i, BaseException)), None)
                deltas = [i for i in items if not isinstance(i, BaseException)]
                if deltas:
                    delta = merge_deltas(deltas)
                    finished = delta.finished
                    yield delta
                if error is not None:
                    raise error
        finally:
            if forward is not None:
                q.closed = True  # what the engine thread still hands on goes nowhere, as a dropped queue's would
            if not finished:
                self._send(AbortRequest(request_id))
            self._streams.pop(request_id, None)
            self._spans.pop(request_id, None)

    async def load_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        """The adapter ``lora_name`` served from ``lora_path``, read, checked and registered on every
        rank now if the engine lacks it (``LLMEngine.load_lora``; its ValueError says what is wrong)."""
        return await self._on_engine_thread(partial(self.engine.load_lora, lora_name, lora_path))

    async def _lora_for(self, lora_name: str, lora_path: str | None) -> LoRARequest:
        held = self.engine.lora_held(lora_name)
        if held is not None or lora_path is None:
            return held or self.engine.lora_named(lora_name)  # the latter raises: model_not_found
        try:
            return await self.load_lora(lora_name, lora_path)
        except InvalidRequest:
            raise
        except ValueError as exc:  # the adapter's files changed since it was loaded at the ingress
            raise InvalidRequest(str(exc), "model") from None

    async def _on_engine_thread(self, fn: Callable):
        self._raise_if_dead()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send(EngineCall(loop, future, fn))
        return await future

    def abort(self, request_id: str) -> bool:
        if request_id not in self._streams:
            return False
        self._send(AbortRequest(request_id))
        return True

    def stats(self) -> EngineStats:
        return self._stats

    def enable_kv_events(self, worker_id: str, sink: Callable[[KVEventBatch], None],
                         ready: Callable[[], bool] = lambda: True) -> None:
        """Publish the KV cache's changes to ``sink``, on the engine thread: a batch after each
        step at which ``ready()`` is true (the sink would send it now; a publisher sends at most
        every so often, and the steps between merge in the engine's own event log instead of as
        a batch each: a GPU engine steps hundreds of times a second), and one at least every
        second while idle. Call before the first request."""
        self._send(EnableKVEvents(worker_id, sink, ready))

    async def kv_snapshot(self) -> KVSnapshot:
        """The KV cache's whole state, taken on the engine thread between two steps."""
        self._raise_if_dead()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send(TakeKVSnapshot(loop, future))
        return await future

    def check_health(self) -> None:
        """Raise when the step loop died, or stopped making progress (see the class docstring)."""
        self._raise_if_dead()
        self.engine.check_health()
        now = time.monotonic()
        started = self._step_started
        if started is not None:
            if now - started > self.step_timeout_s:
                raise EngineDeadError(f"an engine step has run for {now - started:.0f} s "
                                      f"(step timeout {self.step_timeout_s:.0f} s)")
            return
        stalled = now - self._last_progress
        if self.engine.has_unfinished() and stalled > self.stall_timeout_s:
            raise EngineDeadError(f"the engine has made no step for {stalled:.0f} s with work pending")

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self._fail_open_streams(EngineDeadError("the engine was shut down"))
        self.engine.shutdown()

    def _fail_open_streams(self, error: BaseException) -> None:
        for rid in list(self._streams):
            self._deliver(rid, error)

    def _send(self, command: AddRequest | AbortRequest | EnableKVEvents | TakeKVSnapshot | EngineCall) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}") from self._error
        if self._stopped or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    # ---- engine thread ----------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _deliver_step(self, deltas: list[RequestOutputDelta]) -> None:
        """A step's deltas, one hand-off per event loop (each wakes that loop once), not one per
        request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutputDelta]]] = {}
        for delta in deltas:
            if self._spans:
                self._mark_tokens(delta)
            if self._held.interval > 1:
                delta = self._held.release(delta)
                if delta is None:
                    continue
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(put_all, items)

    def _deliver_early(self, deltas: list[RequestOutputDelta]) -> None:
        """The previous step's deltas, handed on while this step's device work runs (async output
        processing)."""
        self._hand_on(self._last_step_started, deltas)

    def _hand_on(self, step_started: float, deltas: list[RequestOutputDelta]) -> None:
        """Deltas of the step that began at ``step_started``: its stats first (a reader of a delta
        sees its step's stats), its metrics, then the streams."""
        now = time.monotonic()
        self._stats = self.engine.stats()
        self._metrics.after_step(step_started, now, self._stats, deltas)
        if deltas:  # a step that schedules nothing while work waits is no progress
            self._last_progress = now
        self._deliver_step(deltas)

    def _mark_tokens(self, delta: RequestOutputDelta) -> None:
        traced = self._spans.get(delta.request_id)
        if traced is not None:
            if not traced[1]:
                tracing.event(traced[0], "engine_first_token")
                traced[1] = True
            if delta.finished:
                tracing.event(traced[0], "engine_finished")

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest):
                try:
                    self.engine.add_checked_request(command.request_id, command.prompt_token_ids, command.params,
                                                    command.extra_keys, command.block_hashes, command.grammar,
                                                    command.resumed, command.priority, command.lora_request)
                except Exception as e:  # a bad request fails alone, never the loop
                    self._deliver(command.request_id, e)
                else:
                    self._metrics.request_added(command.request_id, time.monotonic())
                    if self._spans:
                        traced = self._spans.get(command.request_id)
                        if traced is not None:
                            tracing.event(traced[0], "engine_added")
            elif isinstance(command, AbortRequest):
                delta = self.engine.abort_request(command.request_id)
                if delta is not None:
                    self._metrics.after_abort(time.monotonic(), self.engine.stats(), delta)
                    self._deliver(command.request_id, self._held.release(delta))
            elif isinstance(command, EnableKVEvents):
                self.engine.enable_kv_events(command.worker_id)
                self._kv_sink, self._kv_ready = command.sink, command.ready
            elif isinstance(command, EngineCall):
                resolve(command.loop, command.future, command.fn)
            else:
                resolve(command.loop, command.future, self._kv_snapshot)

    def _kv_snapshot(self) -> KVSnapshot:
        batch, snapshot = self.engine.kv_snapshot()
        if self._kv_sink is not None:
            self._kv_sink(batch)  # no gap in the stream, whoever asked for the snapshot
        return snapshot

    def _publish_kv_events(self) -> None:
        if self._kv_sink is not None:
            self._kv_sink(self.engine.drain_kv_events())

    def _build_and_run(self, args: EngineArgs) -> None:
        try:
            args, self.pinned_threads = platform_of(args, resolve_device(args.device)).prepare_step_thread(args)
            self.engine = LLMEngine(args)
        except BaseException as e:  # the constructor raises it
            self._build_error = e
            return
        finally:
            self._built.set()
        self._started.wait()
        if self._stopped:  # the constructor did not finish: free the weights and KV cache now
            self.engine.shutdown()
            return
        self.engine.on_early_outputs = self._deliver_early
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._stats = self.engine.stats()
                    self._publish_kv_events()  # what aborts changed, or a heartbeat when nothing did
                    self._last_progress = time.monotonic()
                    self._metrics.idle(self._last_progress, self._stats)
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                started = self._step_started = time.monotonic()
                try:
                    deltas = self.engine.step()
                finally:
                    self._step_started = None
                    self._last_step_started = started
                if self._kv_ready():
                    self._publish_kv_events()
                self._hand_on(started, deltas)
        except BaseException as e:  # the loop must never die silently
            logger.exception("engine loop died")
            self._error = e
            self._fail_open_streams(EngineDeadError(f"the engine loop died: {e!r}"))
            if self.on_dead is not None:
                self.on_dead(e)
