"""The ingress's side of KV-aware routing: decide locally, wait for room, fall back.

Each engine request is routed with this ingress's own copy of the global
scheduler's view (``kv_mirror.SchedulerMirror``, kept current by a
``ViewFollower``): the decision is a local computation, with no call to the
scheduler actor on the request's path. The copy's predictions are this
ingress's own routing (the others' show up one feed round trip later, in the
workers' load).

When the copy is older than ``max_staleness_s`` (the actor is dead, restarting
or too busy to answer its feed; a poll still within its wait keeps the copy
current, see ``kv_mirror``, so an actor that hangs without failing is noticed up
to one poll wait later), requests are routed by load instead
(``route_by_inflight``: the workers the view last knew, ranked by the blocks
this ingress's own requests hold on them), counted as fallbacks. Admission
control applies either way: when no worker has room, the request waits in the
``AdmissionQueue``, or is refused (429) past its bound or as soon as its wait
is forecast past the maximum (``room_forecast``: from when the workers report
their running sequences will end; with a stale view the queue goes by its own
departure rate). Only before the
copy has ever heard of a worker (the first moments of an app) does a request
go out unranked, to the request router's power of two choices, bounded by
Serve's queue (``max_queued_requests``).

Everything is counted twice over: in ``RoutingCounters`` (what this replica
saw, for benchmarks and tests) and in the router series of ``RouterMetrics``
(decisions by reason, fallbacks, predicted and realised prefix hits, time to
choose, admission queue length, wait and refusals) for Prometheus.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from pagefleet.router.global_scheduler.kv_mirror import SchedulerMirror
from pagefleet.router.global_scheduler.predictions import Prediction
from pagefleet.router.global_scheduler.views import RouteDecision, RouteRequest
from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.openai.errors import too_many_requests
from pagefleet.router.routing.admission import REJECTION_REASONS, AdmissionQueue, AdmissionRejected
from pagefleet.router.routing.room_forecast import CutShort, Need, forecast_waits, outlook
from pagefleet.worker.replica.kv_publisher import PUBLISH_INTERVAL_S

# How long after a worker frees room this ingress's copy of the view shows it: one publish period
# and one follower interval (``kv_mirror.ViewFollower``'s, 100 ms).
VIEW_LAG_S = PUBLISH_INTERVAL_S + 0.1

# Every reason a kv decision is counted by: the global scheduler's (prefix, load, no_room) and the
# fallbacks without a current view.
KV_REASONS = ("prefix", "load", "no_room", "fallback_stale", "fallback_no_view")


@dataclass(slots=True, frozen=True)
class KVRoutingOptions:
    cost_weight: float = 4.0
    admission_queue_size: int = 64  # 0: admission control off (route even when no worker has room)
    admission_max_wait_s: float = 2.0
    max_staleness_s: float = 1.0  # route by load instead when the view copy is older than this


@dataclass(slots=True)
class RoutingCounters:
    decisions: Counter = field(default_factory=Counter)  # made with a current view, by reason: prefix, load, no_room
    fallbacks: int = 0  # requests routed without a current view (fallback_stale, or fallback_no_view: none yet)
    rejected: int = 0  # 429s
    predicted_hit_blocks: int = 0  # prompt blocks the chosen worker was expected to hold
    realised_hit_blocks: int = 0  # prompt blocks the worker found cached
    choose_s: deque = field(default_factory=lambda: deque(maxlen=10_000))  # decision times, latest


def request_blocks(prompt_len: int, max_tokens: int, n: int, block_size: int,
                   max_blocks_per_seq: int | None = None) -> int:
    """Blocks a request holds at its peak on a worker with nothing cached: each of its ``n``
    sequences grows to prompt + max_tokens; the full prompt blocks are shared among them. With
    ``max_blocks_per_seq`` (a model sliding in every layer) a sequence holds at most that many,
    and its prompt blocks are counted as its own (they leave the window as it grows)."""
    per_seq = -(-(prompt_len + max_tokens) // block_size)
    if max_blocks_per_seq is not None:
        return n * min(per_seq, max_blocks_per_seq)
    return per_seq + (n - 1) * (per_seq - prompt_len // block_size)


def route_by_inflight(total_blocks: Mapping[str, int], inflight_blocks: Mapping[str, int], need: int,
                      max_ranked: int = 8) -> RouteDecision:
    """Routing by load when the view is stale: the workers it last knew (their total blocks),
    fewest blocks held by this ingress's in-flight requests first (then by id); a worker has room
    when its total less those covers ``need``. Pessimistic about caching (no prefix is counted
    as shared), blind to other ingresses' requests."""
    rows = sorted((inflight_blocks.get(w, 0), w) for w in total_blocks)
    with_room = [w for held, w in rows if total_blocks[w] - held >= need]
    if with_room:
        return RouteDecision(with_room[:max_ranked], True, "fallback_stale", 0)
    return RouteDecision([w for _, w in rows][:max_ranked], False, "fallback_stale", 0)


class KVRoutingClient:
    def __init__(self, mirror: SchedulerMirror, options: KVRoutingOptions, block_size: int,
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 max_blocks_per_seq: int | None = None) -> None:
        self.mirror = mirror
        self.options = options
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq  # ModelInfo's: set for a model sliding in every layer
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.metrics.start_at_zero("routing_decisions", *({"policy": "kv", "reason": r} for r in KV_REASONS))
        self.metrics.start_at_zero("admission_rejections",
                                   *({"reason": r} for r in (*REJECTION_REASONS, "worker_queue_full")))
        self.metrics.start_at_zero("prefix_hit_blocks_predicted")
        self.metrics.start_at_zero("prefix_hit_blocks_realised")
        self.admission = (AdmissionQueue(options.admission_queue_size, options.admission_max_wait_s, clock=clock,
                                         on_length=lambda n: self.metrics.set("admission_queue_length", n),
                                         on_wait=lambda s: self.metrics.observe("admission_wait_seconds", s),
                                         forecast=self.forecast_waits)
                          if options.admission_queue_size > 0 else None)
        self.counters = RoutingCounters()
        self._inflight: Counter = Counter()  # worker -> blocks this ingress's routed requests may hold there
        self._routed: dict[str, tuple[str, int, int]] = {}  # request id -> (worker, blocks, seqs), blocks in ``_inflight``
        self._cut_short: deque[CutShort] = deque()  # in the order they ended, until the view shows them
        self._ended: deque[str] = deque()  # requests that ended, noticed where no count may change

    async def route(self, request_id: str, block_hashes: bytes, prompt_len: int, max_tokens: int,
                    n: int, priority: int = 0) -> RouteDecision | None:
        """Where the request goes (None: no worker known yet, route without a ranking); one that
        waits for room waits by ``priority`` (``AdmissionQueue``). Raises OpenAIError 429."""
        need = request_blocks(prompt_len, max_tokens, n, self.block_size, self.max_blocks_per_seq)
        req = RouteRequest(request_id, block_hashes, need, n, max_tokens)
        if self.admission is None:
            decision = self._decide(req, force=True)
        else:
            decision = await self._admit(req, priority)
        reason = "fallback_no_view" if decision is None else decision.reason
        self.metrics.inc("routing_decisions", policy="kv", reason=reason)
        if decision is None or reason == "fallback_stale":
            self.counters.fallbacks += 1
        else:
            self.counters.decisions[reason] += 1
            self.counters.predicted_hit_blocks += decision.predicted_hit_blocks
            self.metrics.inc("prefix_hit_blocks_predicted", decision.predicted_hit_blocks)
        if decision is not None:
            self._hold(request_id, decision.ranking[0], req.num_blocks, req.num_seqs)
        return decision

    def finished(self, request_id: str, cut_short: bool = False) -> None:
        """The request ended: its blocks leave this ingress's in-flight count, and the room its
        worker has not yet reported it taking is not predicted taken any more. ``cut_short``: it
        ended before its worker finished it (its client went away, it failed); if the worker had
        taken it in, the forecast counts its room back once the abort lands (``room_forecast``),
        not after all its ``max_tokens`` steps as the worker's last batch says."""
        held = self._unhold(request_id)
        if not self.mirror.core.withdraw(request_id) and cut_short and held is not None:
            self._cut_short.append(CutShort(held[0], self.clock(), held[1], held[2]))
        self._prune_cut_short()

    def _unhold(self, request_id: str) -> tuple[str, int, int] | None:
        held = self._routed.pop(request_id, None)
        if held is not None:
            worker, blocks, _ = held
            self._inflight[worker] -= blocks
            if not self._inflight[worker]:
                del self._inflight[worker]
        return held

    def _shown(self, c: CutShort, now: float) -> bool:
        """Whether ``c``'s worker's view shows its room back (a batch reached the copy after the
        abort landed and was published), or will not (the worker is gone, or the view is past
        trusting)."""
        view = self.mirror.core.workers.get(c.worker_id)
        if view is None:
            return True
        due = c.at + view.step_time_s + VIEW_LAG_S
        return view.releases_at >= due or now >= due + self.options.max_staleness_s

    def _prune_cut_short(self) -> None:
        now = self.clock()
        while self._cut_short and self._shown(self._cut_short[0], now):
            self._cut_short.popleft()

    def check_room(self) -> None:
        """Raises OpenAIError 429 when admission control would refuse a request arriving now
        without letting it wait (the queue is full, or would take too long to reach it)."""
        if self.admission is not None:
            try:
                self.admission.check_room()
            except AdmissionRejected as exc:
                raise self._refused(exc) from exc

    def forecast_waits(self, needs: list[Need]) -> list[float] | None:
        """The admission queue's forecast (``room_forecast``) over this ingress's copy of the view;
        None while it cannot say (a stale copy, a request of its own unreported past the staleness
        limit, or no worker has measured a step yet)."""
        now = self.clock()
        if self.mirror.age(now) > self.options.max_staleness_s:
            return None
        core = self.mirror.core
        views = [v for v in core.workers.values() if v.reported]
        if not any(v.step_time_s > 0 for v in views):
            return None
        routed: dict[int, list[Prediction]] = {}  # slot -> this ingress's requests it has not reported yet
        for pred in core.predictions.by_request.values():
            if not pred.confirmed:
                if now - pred.made_at > self.options.max_staleness_s:
                    # a request routed this long ago that no worker reported: the copy is behind the
                    # workers (the actor restarting, say), and its room would be counted twice
                    return None
                routed.setdefault(pred.slot, []).append(pred)
        cut_short: dict[str, list[CutShort]] = {}  # worker -> requests it still shows running that ended here
        for c in self._cut_short:
            if not self._shown(c, now):
                cut_short.setdefault(c.worker_id, []).append(c)
        return forecast_waits([outlook(v, now, VIEW_LAG_S, routed.get(v.slot, ()), cut_short.get(v.worker_id, ()))
                               for v in views], needs)

    async def _admit(self, req: RouteRequest, priority: int) -> RouteDecision | None:
        async def attempt() -> RouteDecision | None:
            return self._decide(req, force=False)

        try:
            return await self.admission.admit(attempt, lambda d: d is None or d.admitted,
                                              Need(req.num_blocks, req.num_seqs), priority)
        except AdmissionRejected as exc:
            raise self._refused(exc) from exc

    def _refused(self, exc: AdmissionRejected) -> Exception:
        self.counters.rejected += 1
        self.metrics.inc("admission_rejections", reason=exc.reason)
        return too_many_requests(str(exc), exc.retry_after_s)

    def _decide(self, req: RouteRequest, force: bool) -> RouteDecision | None:
        while self._ended:
            self.finished(self._ended.popleft())
        started = time.perf_counter()
        now = self.clock()
        core = self.mirror.core
        if self.mirror.age(now) <= self.options.max_staleness_s:
            decision = core.route(req, now, force=force)
        else:
            totals = {w: v.num_total_blocks for w, v in core.workers.items()}
            decision = route_by_inflight(totals, self._inflight, req.num_blocks)
        elapsed = time.perf_counter() - started
        self.counters.choose_s.append(elapsed)
        self.metrics.observe("routing_seconds", elapsed)
        return None if not decision.ranking else decision

    def ended_later(self, request_id: str) -> None:
        """``finished``, from anywhere (a garbage collector's finalizer: a routed request dropped
        unrun); applied at the next decision."""
        self._ended.append(request_id)

    def _hold(self, request_id: str, worker: str, blocks: int, seqs: int) -> None:
        self._unhold(request_id)  # a request routed again (a retry) holds blocks once
        self._routed[request_id] = (worker, blocks, seqs)
        self._inflight[worker] += blocks

    def record_realised(self, num_cached_tokens: int) -> None:
        self.counters.realised_hit_blocks += num_cached_tokens // self.block_size
        self.metrics.inc("prefix_hit_blocks_realised", num_cached_tokens // self.block_size)
