"""Per-request timestamps and per-step engine facts, gathered into one batch between flushes.

Runs on the engine thread with plain Python only: the engine calls
``add_request`` / ``scheduled`` / ``step`` and, every flush interval, hands
``take()`` to a recorder, which records the whole batch in bulk. Nothing here
is per token: each step touches the requests that step touched, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from pagefleet.worker.metrics.stats import EngineStats
from pagefleet.worker.outputs import RequestOutputDelta


@dataclass(slots=True)
class EngineMetricsBatch:
    """Engine facts since the last flush; field names are the keys of ``ENGINE_METRICS``."""

    # gauges: the latest values
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # counters: increments since the last flush
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> sequences
    # histograms: one observation per request (itl: per request per output step)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    request_prompt_tokens: list[int] = field(default_factory=list)
    request_generation_tokens: list[int] = field(default_factory=list)


class _RequestTimes:
    __slots__ = ("arrival", "scheduled", "last_token", "num_generated")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.scheduled: float | None = None
        self.last_token: float | None = None
        self.num_generated = 0


# EngineStats counters -> the batch counter each one feeds.
_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries"),
    ("prefix_cache_hits", "prefix_cache_hits"),
    ("num_preemptions", "preemptions"),
    ("prompt_tokens_total", "prompt_tokens"),
    ("generation_tokens_total", "generation_tokens"),
)


class EngineMetricsCollector:
    def __init__(self, stats: EngineStats) -> None:
        self._requests: dict[str, _RequestTimes] = {}
        self._last = stats
        self._batch = EngineMetricsBatch()
        self._set_gauges(stats)

    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    def add_request(self, request_id: str, now: float) -> None:
        self._requests[request_id] = _RequestTimes(now)

    def scheduled(self, request_ids: Iterable[str], now: float) -> None:
        """Requests that got compute this step; the first time is the end of their queue time."""
        for rid in request_ids:
            times = self._requests.get(rid)
            if times is not None and times.scheduled is None:
                times.scheduled = now
                self._batch.queue_time.append(now - times.arrival)

    def step(self, now: float, stats: EngineStats, deltas: Iterable[RequestOutputDelta]) -> None:
        """One engine step's (or abort's) deltas and the engine's counters after it."""
        batch = self._batch
        for delta in deltas:
            times = self._requests.get(delta.request_id)
            if times is None:
                continue
            new_tokens = 0
            for seq in delta.sequences:
                new_tokens += len(seq.token_ids)
                if seq.finish_reason is not None:
                    batch.finished[seq.finish_reason] = batch.finished.get(seq.finish_reason, 0) + 1
            if new_tokens:
                if times.last_token is None:
                    batch.ttft.append(now - times.arrival)
                else:
                    batch.itl.append(now - times.last_token)
                times.last_token = now
                times.num_generated += new_tokens
            if delta.finished:
                del self._requests[delta.request_id]
                batch.e2e.append(now - times.arrival)
                batch.request_prompt_tokens.append(delta.num_prompt_tokens)
                batch.request_generation_tokens.append(times.num_generated)
        self.update(stats)

    def update(self, stats: EngineStats) -> None:
        """Counters and gauges from the engine's latest stats (also while idle)."""
        batch, last = self._batch, self._last
        for stat, name in _COUNTERS:
            grown = getattr(stats, stat) - getattr(last, stat)
            if grown:
                setattr(batch, name, getattr(batch, name) + grown)
        self._set_gauges(stats)
        self._last = stats

    def _set_gauges(self, stats: EngineStats) -> None:
        batch = self._batch
        batch.num_running = stats.num_running
        batch.num_waiting = stats.num_waiting
        total = stats.num_total_blocks
        batch.kv_cache_usage = (total - stats.num_free_blocks) / total if total else 0.0

    def take(self) -> EngineMetricsBatch:
        """The batch so far; the next one starts empty, with the current gauges."""
        batch = self._batch
        self._batch = EngineMetricsBatch(batch.num_running, batch.num_waiting, batch.kv_cache_usage)
        return batch
