"""The periodic engine stats line (as vLLM logs it): throughput, queue, KV usage, prefix hits."""

from __future__ import annotations

from pagefleet.worker.metrics.stats import EngineStats


def stats_line(prev: EngineStats, cur: EngineStats, elapsed_s: float) -> str:
    """Throughputs over the ``elapsed_s`` since ``prev``; the rest as of ``cur``."""
    prompt_tps = (cur.prompt_tokens_total - prev.prompt_tokens_total) / elapsed_s
    gen_tps = (cur.generation_tokens_total - prev.generation_tokens_total) / elapsed_s
    usage = 1.0 - cur.num_free_blocks / cur.num_total_blocks if cur.num_total_blocks else 0.0
    queries = cur.prefix_cache_queries - prev.prefix_cache_queries
    hit_rate = (cur.prefix_cache_hits - prev.prefix_cache_hits) / queries if queries else 0.0
    return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {cur.num_running} reqs, Waiting: {cur.num_waiting} reqs, KV cache usage: {usage:.1%}, "
            f"Prefix cache hit rate: {hit_rate:.1%}")


class StatsLogger:
    """Says ``stats_line`` every ``interval_s`` while the engine is busy (or moved since the last line)."""

    def __init__(self, interval_s: float, stats: EngineStats, now: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"the stats log interval must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._last = stats
        self._last_at = now

    def due(self, stats: EngineStats, now: float) -> str | None:
        """The line to log now, or None (not yet time, or idle with nothing done since the last one)."""
        elapsed = now - self._last_at
        if elapsed < self.interval_s:
            return None
        busy = stats.num_running or stats.num_waiting or stats.num_steps != self._last.num_steps
        line = stats_line(self._last, stats, elapsed) if busy else None
        self._last, self._last_at = stats, now
        return line
