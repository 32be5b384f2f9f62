"""What an engine loop reports about itself: metrics (batched, flushed to a recorder) and the stats line.

The loop that drives an ``LLMEngine`` (``AsyncLLMEngine``'s thread, or
``LLM.generate``) calls ``request_added``, ``after_step``, ``after_abort`` and
``idle``; each is cheap plain Python. Every ``flush_interval_s`` the gathered
batch goes to the recorder in one call (``recorder.py`` records it
with Ray); every ``log_interval_s`` of work one stats line is logged.
"""

from __future__ import annotations

import logging
from typing import Protocol

from pagefleet.worker.metrics.collector import EngineMetricsBatch, EngineMetricsCollector
from pagefleet.worker.metrics.stats import EngineStats
from pagefleet.worker.metrics.stats_log import StatsLogger
from pagefleet.worker.outputs import RequestOutputDelta

logger = logging.getLogger("pagefleet.engine")

FLUSH_INTERVAL_S = 1.0  # Ray's agents export every 10 s; once a second keeps the batch small


class MetricsRecorder(Protocol):
    def record(self, batch: EngineMetricsBatch) -> None: ...


class EngineMetrics:
    def __init__(self, stats: EngineStats, now: float, *, recorder: MetricsRecorder | None = None,
                 log_interval_s: float = 0.0, flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        self._recorder = recorder
        self._collector = EngineMetricsCollector(stats) if recorder is not None else None
        self._log = StatsLogger(log_interval_s, stats, now) if log_interval_s > 0 else None
        self._flush_interval_s = flush_interval_s
        self._flushed_at = now
        self._record_failed = False

    def request_added(self, request_id: str, now: float) -> None:
        if self._collector is not None:
            self._collector.add_request(request_id, now)

    def after_step(self, started: float, now: float, stats: EngineStats, deltas: list[RequestOutputDelta]) -> None:
        """A step that began at ``started``: every request it scheduled has a delta in ``deltas``."""
        if self._collector is not None:
            self._collector.scheduled((d.request_id for d in deltas), started)
            self._collector.step(now, stats, deltas)
        self._tick(now, stats)

    def after_abort(self, now: float, stats: EngineStats, delta: RequestOutputDelta) -> None:
        if self._collector is not None:
            self._collector.step(now, stats, [delta])

    def idle(self, now: float, stats: EngineStats) -> None:
        if self._collector is not None:
            self._collector.update(stats)
        self._tick(now, stats)

    def flush(self) -> None:
        if self._collector is None:
            return
        batch = self._collector.take()
        try:
            self._recorder.record(batch)
        except Exception:  # metrics must never stop the engine loop; this batch is lost, say so once
            if not self._record_failed:
                logger.exception("recording engine metrics failed; the engine goes on (further failures "
                                 "are not logged)")
            self._record_failed = True

    def _tick(self, now: float, stats: EngineStats) -> None:
        if self._collector is not None and now - self._flushed_at >= self._flush_interval_s:
            self._flushed_at = now
            self.flush()
        if self._log is not None:
            line = self._log.due(stats, now)
            if line is not None:
                logger.info("%s", line)
