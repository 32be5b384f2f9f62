"""The ingress's side of KV-aware routing: decide locally, wait for room, fall back.

Each engine request is routed with this ingress's own copy of the global
scheduler's view (``kv_mirror.SchedulerMirror``, kept current by a
``ViewFollower``): the decision is a local computation of well under a
millisecond, with no call to the scheduler actor on the request's path. The
copy's predictions are this ingress's own routing (the others' show up one
feed round trip later, in the workers' load).

When the copy is older than ``max_staleness_s`` (the actor is dead, restarting
or too busy to answer its feed), requests are routed by load instead
(``route_by_inflight``: the workers the view last knew, ranked by the blocks
this ingress's own requests hold on them), counted as fallbacks. Admission
control applies either way: when no worker has room, the request waits in the
``AdmissionQueue``, or is refused (429) past its bound or wait, or at once when
it would wait too long: ``admission_wait`` plays the queue forward over the
predicted ends of this ingress's running requests (each has ``max_tokens`` less
the tokens streamed so far to go, at the pace its own stream has kept, or, not
started yet, the time to first token and pace its completed predecessors had).
Only before the
copy has ever heard of a worker (the first moments of an app) does a request
go out unranked, to the request router's power of two choices, bounded by
Serve's queue (``max_queued_requests``).

Everything is counted twice over: in ``RoutingCounters`` (what this replica
saw, for benchmarks and tests) and in the router series of ``RouterMetrics``
(decisions by reason, fallbacks, predicted and realised prefix hits, time to
choose, admission queue length, wait and refusals) for Prometheus.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from pagefleet.router.admission import AdmissionQueue, AdmissionRejected, smoothed
from pagefleet.router.errors import too_many_requests
from pagefleet.router.global_scheduler import RouteDecision, RouteRequest
from pagefleet.router.kv_mirror import SchedulerMirror
from pagefleet.router.metrics import RouterMetrics


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


def request_blocks(prompt_len: int, max_tokens: int, n: int, block_size: int) -> int:
    """Blocks a request holds at its peak on a worker with nothing cached: each of its ``n``
    sequences grows to prompt + max_tokens; the full prompt blocks are shared among them."""
    per_seq = -(-(prompt_len + max_tokens) // block_size)
    return per_seq + (n - 1) * (per_seq - prompt_len // block_size)


@dataclass(slots=True)
class _Routed:
    """A request this ingress routed, until its stream ends."""

    worker: str
    blocks: int  # counted in the ingress's in-flight load: its peak with nothing cached
    new_blocks: int  # what it takes out of that worker's room: its peak less its cached prefix
    seqs: int
    max_tokens: int
    at: float  # routed at (the client's clock)
    tokens: int = 0  # streamed so far (per sequence)
    first_at: float | None = None  # its first delta's arrival
    first_tokens: int = 0  # in its first delta
    last_at: float | None = None  # its latest delta's arrival

    def ends_at(self, now: float, ttft_s: float, tpot_s: float) -> float:
        """When it is expected to end: ``max_tokens`` at its own pace once it has one (else
        ``tpot_s``), after a first token ``ttft_s`` from routing if none has come yet."""
        if self.first_at is None:
            return max(now, self.at + ttft_s) + (self.max_tokens - 1) * tpot_s
        return max(now, self.last_at + (self.max_tokens - self.tokens) * self.pace(tpot_s))

    def pace(self, default: float) -> float:
        """Seconds per token since its first delta (``default`` before a second one)."""
        after = self.tokens - self.first_tokens
        return (self.last_at - self.first_at) / after if after > 0 else default


@dataclass(slots=True)
class _Waiting:
    """A request in the admission queue, as ``admission_wait`` sees it."""

    req: RouteRequest
    max_tokens: int
    cached: dict[str, int] = field(default_factory=dict)  # worker -> prompt blocks it holds (latest decision)

    def need_at(self, worker: str) -> int:
        return max(self.req.num_blocks - self.cached.get(worker, 0), 0)


def admission_wait(now: float, room: Mapping[str, float], seats: Mapping[str, float],
                   ends: Iterable[tuple[float, str, int, int]],
                   queue: Sequence[tuple[Callable[[str], int], int, float]]) -> float | None:
    """Seconds from ``now`` until the last request of ``queue`` gets a worker, if room comes
    back only as running requests end (None: not before the known ends run out).

    ``room`` and ``seats``: each worker's free blocks and sequence seats now, where nobody in
    ``queue`` fits; ``ends``: (time, worker, blocks, seqs) that each running request gives back
    when it ends; ``queue``: first first, each (the blocks it needs on a worker, its seqs, how
    long it runs once admitted). Only the first waiter can go (FIFO); it takes the worker where
    it needs the fewest blocks (most room on a tie), and gives them back when it ends."""
    heap = list(ends)
    heapq.heapify(heap)
    room, seats = dict(room), dict(seats)
    admitted = 0
    checked = False  # whether the first waiter has been tried on every worker since it became first
    while heap:
        t, worker, blocks, seqs = heapq.heappop(heap)
        if worker not in room:  # a worker the view no longer has
            continue
        room[worker] += blocks
        seats[worker] += seqs
        while admitted < len(queue):
            need_at, n, runs_s = queue[admitted]
            # Tried everywhere once; after that only where room has just come back can it fit.
            candidates = (worker,) if checked else room
            fits = [(need_at(w), -room[w], w) for w in candidates if seats[w] >= n and room[w] >= need_at(w)]
            if not fits:
                checked = True
                break
            need, _, w = min(fits)
            room[w] -= need
            seats[w] -= n
            admitted += 1
            checked = False
            if admitted == len(queue):
                return max(t - now, 0.0)
            heapq.heappush(heap, (t + runs_s, w, need, n))
    return None


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
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.mirror = mirror
        self.options = options
        self.block_size = block_size
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.admission = (AdmissionQueue(options.admission_queue_size, options.admission_max_wait_s, clock=clock,
                                         on_length=lambda n: self.metrics.set("admission_queue_length", n),
                                         on_wait=lambda s: self.metrics.observe("admission_wait_seconds", s),
                                         estimate=self._estimate_wait)
                          if options.admission_queue_size > 0 else None)
        self.counters = RoutingCounters()
        self._inflight: Counter = Counter()  # worker -> blocks this ingress's routed requests may hold there
        self._routed: dict[str, _Routed] = {}  # request id -> where it went (its blocks are in ``_inflight``)
        self._ended: deque[str] = deque()  # requests that ended, noticed where no count may change
        # Time to first token from routing, and seconds per further token, of the requests that
        # completed (moving averages; None until one has): the pace of those not streaming yet.
        self.ttft_s: float | None = None
        self.tpot_s: float | None = None

    async def route(self, request_id: str, block_hashes: bytes, prompt_len: int, max_tokens: int,
                    n: int) -> RouteDecision | None:
        """Where the request goes (None: no worker known yet, route without a ranking).
        Raises OpenAIError 429."""
        req = RouteRequest(request_id, block_hashes, request_blocks(prompt_len, max_tokens, n, self.block_size), n)
        if self.admission is None:
            decision = self._decide(req, force=True)
        else:
            decision = await self._admit(req, max_tokens)
        reason = "fallback_no_view" if decision is None else decision.reason
        self.metrics.inc("routing_decisions", policy="kv", reason=reason)
        if decision is None or reason == "fallback_stale":
            self.counters.fallbacks += 1
        else:
            self.counters.decisions[reason] += 1
            self.counters.predicted_hit_blocks += decision.predicted_hit_blocks
            self.metrics.inc("prefix_hit_blocks_predicted", decision.predicted_hit_blocks)
        if decision is not None:
            self._hold(request_id, _Routed(decision.ranking[0], req.num_blocks,
                                           max(req.num_blocks - decision.predicted_hit_blocks, 0), n, max_tokens,
                                           self.clock()))
        return decision

    def streamed(self, request_id: str, tokens: int) -> None:
        """The request's stream brought ``tokens`` more (per sequence): its pace so far."""
        held = self._routed.get(request_id)
        if held is None or not tokens:
            return
        now = self.clock()
        if held.first_at is None:
            held.first_at, held.first_tokens = now, tokens
        held.tokens += tokens
        held.last_at = now

    def finished(self, request_id: str, completed: bool = False) -> None:
        """The request ended: its blocks leave this ingress's in-flight count. A ``completed``
        one (it ran to its end, not aborted) also times the requests not streaming yet."""
        held = self._routed.pop(request_id, None)
        if held is None:
            return
        self._inflight[held.worker] -= held.blocks
        if not self._inflight[held.worker]:
            del self._inflight[held.worker]
        if completed and held.tokens > held.first_tokens:
            self.ttft_s = smoothed(self.ttft_s, held.first_at - held.at, 0.2)
            self.tpot_s = smoothed(self.tpot_s, held.pace(0.0), 0.2)

    def check_room(self) -> None:
        """Raises OpenAIError 429 when admission control would refuse a request arriving now
        without letting it wait (the queue is full, or would take too long to reach it)."""
        if self.admission is not None:
            try:
                self.admission.check_room()
            except AdmissionRejected as exc:
                raise self._refused(exc) from exc

    async def _admit(self, req: RouteRequest, max_tokens: int) -> RouteDecision | None:
        waiting = _Waiting(req, max_tokens)

        async def attempt() -> RouteDecision | None:
            decision = self._decide(req, force=False)
            if decision is not None and not decision.admitted:
                waiting.cached = {s.worker_id: s.cached_blocks for s in decision.scores if s.cached_blocks}
            return decision

        try:
            return await self.admission.admit(attempt, lambda d: d is None or d.admitted, waiting)
        except AdmissionRejected as exc:
            raise self._refused(exc) from exc

    def _estimate_wait(self, ahead: Sequence[_Waiting], newcomer: _Waiting) -> float | None:
        """How long ``newcomer`` would wait behind ``ahead`` (``admission_wait`` over this
        ingress's running requests, plus a time to first token; None without a current view or
        a timing yet)."""
        ttft, tpot = self.ttft_s, self.tpot_s
        now = self.clock()
        if ttft is None or not self._routed or self.mirror.age(now) > self.options.max_staleness_s:
            return None
        views = self.mirror.core.workers
        room = {w: math.inf if v.room_blocks is None else v.room_blocks for w, v in views.items()}
        seats = {w: v.seats for w, v in views.items()}
        ends = [(r.ends_at(now, ttft, tpot), r.worker, r.new_blocks, r.seqs) for r in self._routed.values()]
        queue = [(w.need_at, w.req.num_seqs, ttft + (w.max_tokens - 1) * tpot) for w in (*ahead, newcomer)]
        wait = admission_wait(now, room, seats, ends, queue)
        # Paces drawn from past tokens miss the prefills a worker has yet to run for requests
        # routed to it: each stalls its running streams for about one time to first token.
        return None if wait is None else wait + ttft

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

    def _hold(self, request_id: str, routed: _Routed) -> None:
        self.finished(request_id)  # a request routed again (a retry) holds blocks once
        self._routed[request_id] = routed
        self._inflight[routed.worker] += routed.blocks

    def record_realised(self, num_cached_tokens: int) -> None:
        self.counters.realised_hit_blocks += num_cached_tokens // self.block_size
        self.metrics.inc("prefix_hit_blocks_realised", num_cached_tokens // self.block_size)
