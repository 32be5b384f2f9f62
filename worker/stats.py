"""Engine counters, as plain data (published to routers and metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int     # of those, tokens served from the cache
    num_preemptions: int
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int
