"""The ingress's side of KV-aware routing: ask the global scheduler, wait for room, fall back.

For each engine request the ingress asks the scheduler actor for a ranking
(one actor call, awaited, never blocking the event loop). No answer within
``timeout_s`` (the scheduler is slow, dead or restarting) means routing
without it: the request router falls back to the power of two choices, and
the fallback is counted; after a failed call the scheduler is not asked again
for ``skip_after_failure_s``, so a dead scheduler costs no request a timeout
(a hung or restarting one costs each request at most ``timeout_s``).
When the scheduler says no worker has room, the request waits in the
``AdmissionQueue``, or is refused (429) past its bound or wait.

Everything is counted twice over: in ``RoutingCounters`` (what this replica
saw, for benchmarks and tests) and in the router series of ``RouterMetrics``
(decisions by reason, fallbacks, predicted and realised prefix hits, time to
choose, admission queue length, wait and refusals) for Prometheus.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from pagefleet.router.admission import AdmissionQueue, AdmissionRejected
from pagefleet.router.errors import too_many_requests
from pagefleet.router.global_scheduler import RouteDecision, RouteRequest
from pagefleet.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class KVRoutingOptions:
    cost_weight: float = 4.0
    admission_queue_size: int = 64  # 0: admission control off (route even when no worker has room)
    admission_max_wait_s: float = 2.0
    timeout_s: float = 0.010


@dataclass(slots=True)
class RoutingCounters:
    decisions: Counter = field(default_factory=Counter)  # by reason: prefix, load, no_room
    fallbacks: int = 0  # requests routed without the scheduler's answer
    rejected: int = 0  # 429s
    predicted_hit_blocks: int = 0  # prompt blocks the chosen worker was expected to hold
    realised_hit_blocks: int = 0  # prompt blocks the worker found cached
    choose_s: deque = field(default_factory=lambda: deque(maxlen=10_000))  # scheduler round trips, latest


def request_blocks(prompt_len: int, max_tokens: int, n: int, block_size: int) -> int:
    """Blocks a request holds at its peak on a worker with nothing cached: each of its ``n``
    sequences grows to prompt + max_tokens; the full prompt blocks are shared among them."""
    per_seq = -(-(prompt_len + max_tokens) // block_size)
    return per_seq + (n - 1) * (per_seq - prompt_len // block_size)


class KVRoutingClient:
    def __init__(self, scheduler: Any, options: KVRoutingOptions, block_size: int,
                 metrics: RouterMetrics | None = None) -> None:
        self.scheduler = scheduler
        self.options = options
        self.block_size = block_size
        self.metrics = metrics or RouterMetrics()
        self.admission = (AdmissionQueue(options.admission_queue_size, options.admission_max_wait_s,
                                         on_length=lambda n: self.metrics.set("admission_queue_length", n),
                                         on_wait=lambda s: self.metrics.observe("admission_wait_seconds", s))
                          if options.admission_queue_size > 0 else None)
        self.counters = RoutingCounters()
        self.skip_after_failure_s = 1.0
        self._skip_until = 0.0

    async def route(self, request_id: str, block_hashes: bytes, prompt_len: int, max_tokens: int,
                    n: int) -> RouteDecision | None:
        """The scheduler's decision (None: route without it). Raises OpenAIError 429."""
        req = RouteRequest(request_id, block_hashes, request_blocks(prompt_len, max_tokens, n, self.block_size), n)
        if self.admission is None:
            decision = await self._ask(req, force=True)
        else:
            decision = await self._admit(req)
        if decision is None:
            self.counters.fallbacks += 1
            self.metrics.inc("routing_decisions", policy="kv", reason="fallback_no_scheduler")
            return None
        self.counters.decisions[decision.reason] += 1
        self.counters.predicted_hit_blocks += decision.predicted_hit_blocks
        self.metrics.inc("routing_decisions", policy="kv", reason=decision.reason)
        self.metrics.inc("prefix_hit_blocks_predicted", decision.predicted_hit_blocks)
        return decision

    async def _admit(self, req: RouteRequest) -> RouteDecision | None:
        try:
            return await self.admission.admit(lambda: self._ask(req, force=False), lambda d: d is None or d.admitted)
        except AdmissionRejected as exc:
            self.counters.rejected += 1
            self.metrics.inc("admission_rejections", reason=exc.reason)
            raise too_many_requests(str(exc), exc.retry_after_s) from exc

    async def _ask(self, req: RouteRequest, force: bool) -> RouteDecision | None:
        if time.monotonic() < self._skip_until:
            return None
        started = time.perf_counter()
        try:
            decision = await asyncio.wait_for(self.scheduler.route.remote(req, force), self.options.timeout_s)
        except asyncio.TimeoutError:
            return None  # slow this time; ask again next time
        except Exception as exc:  # dead: do not make every request wait to find out
            logger.warning("the global scheduler did not answer (%r); routing without it for %.1f s", exc,
                           self.skip_after_failure_s)
            self._skip_until = time.monotonic() + self.skip_after_failure_s
            return None
        elapsed = time.perf_counter() - started
        self.counters.choose_s.append(elapsed)
        self.metrics.observe("routing_seconds", elapsed)
        return decision

    def record_realised(self, num_cached_tokens: int) -> None:
        self.counters.realised_hit_blocks += num_cached_tokens // self.block_size
        self.metrics.inc("prefix_hit_blocks_realised", num_cached_tokens // self.block_size)
