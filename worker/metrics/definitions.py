"""The engine's metrics: names, kinds, buckets and tags, as data (no Ray, no torch).

Names are vLLM's with ``pagefleet_`` in place of ``vllm:`` (Ray's metric API
refuses ``:``). They are recorded with ``ray.util.metrics`` by
``recorder.py`` and leave each node through Ray's metrics agent, which
adds the ``ray_`` prefix (and ``_total`` to counters), as it does for every
application metric: ``vllm:prompt_tokens_total`` here is
``ray_pagefleet_prompt_tokens_total``. docs/metrics.md holds the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "pagefleet_"
EXPORT_PREFIX = "ray_"  # added by Ray's metrics agent to every metric it exports
ENGINE_TAGS = ("model_name", "replica")
FINISH_REASONS = ("stop", "length", "abort")  # request_success's finished_reason values

# vLLM's bucket boundaries (V1 loggers), so dashboards and SLOs carry over unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_count_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's 1-2-5 series for token counts)."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: ``name`` is what ``ray.util.metrics`` registers; ``exported`` what Prometheus sees."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    vllm_name: str | None = None  # the vLLM series it mirrors, if any
    buckets: tuple[float, ...] = ()  # histograms; empty: sized per model (token counts)
    tag_keys: tuple[str, ...] = ENGINE_TAGS

    def __post_init__(self) -> None:
        if self.kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"unknown metric kind {self.kind!r}")
        if not self.name.startswith(PREFIX):
            raise ValueError(f"metric {self.name!r} must start with {PREFIX!r}")

    @property
    def exported(self) -> str:
        return EXPORT_PREFIX + self.name + ("_total" if self.kind == "counter" else "")


def _spec(short: str, kind: str, description: str, vllm: str | None = None, **kw) -> MetricSpec:
    return MetricSpec(PREFIX + short, kind, description, vllm, **kw)


# Keyed by the ``EngineMetricsBatch`` field (collector.py) that feeds each one.
ENGINE_METRICS: dict[str, MetricSpec] = {
    "num_running": _spec("num_requests_running", "gauge", "Sequences in the running batch.",
                         "vllm:num_requests_running"),
    "num_waiting": _spec("num_requests_waiting", "gauge", "Sequences waiting to be scheduled.",
                         "vllm:num_requests_waiting"),
    "kv_cache_usage": _spec("kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0 to 1).",
                            "vllm:kv_cache_usage_perc"),
    "prefix_cache_queries": _spec("prefix_cache_queries", "counter",
                                  "Prompt tokens looked up in the prefix cache.", "vllm:prefix_cache_queries"),
    "prefix_cache_hits": _spec("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.",
                               "vllm:prefix_cache_hits"),
    "preemptions": _spec("num_preemptions", "counter", "Sequences preempted (by recompute).",
                         "vllm:num_preemptions"),
    "prompt_tokens": _spec("prompt_tokens", "counter", "Prompt tokens of admitted requests.",
                           "vllm:prompt_tokens"),
    "generation_tokens": _spec("generation_tokens", "counter", "Tokens generated.", "vllm:generation_tokens"),
    "finished": _spec("request_success", "counter", "Finished sequences by finish reason (stop, length, abort).",
                      "vllm:request_success", tag_keys=ENGINE_TAGS + ("finished_reason",)),
    "ttft": _spec("time_to_first_token_seconds", "histogram", "Arrival at the engine to the first output token.",
                  "vllm:time_to_first_token_seconds", buckets=TTFT_BUCKETS),
    "itl": _spec("inter_token_latency_seconds", "histogram", "Time between a request's successive output steps.",
                 "vllm:inter_token_latency_seconds", buckets=ITL_BUCKETS),
    "e2e": _spec("e2e_request_latency_seconds", "histogram", "Arrival at the engine to the request's finish.",
                 "vllm:e2e_request_latency_seconds", buckets=REQUEST_LATENCY_BUCKETS),
    "queue_time": _spec("request_queue_time_seconds", "histogram", "Arrival at the engine to first scheduled.",
                        "vllm:request_queue_time_seconds", buckets=REQUEST_LATENCY_BUCKETS),
    "request_prompt_tokens": _spec("request_prompt_tokens", "histogram", "Prompt tokens per finished request.",
                                   "vllm:request_prompt_tokens"),
    "request_generation_tokens": _spec("request_generation_tokens", "histogram",
                                       "Generated tokens per finished request (all its n sequences).",
                                       "vllm:request_generation_tokens"),
}


def histogram_buckets(spec: MetricSpec, max_model_len: int) -> tuple[float, ...]:
    """A histogram's boundaries: its own, or the token-count series sized to the model."""
    if spec.kind != "histogram":
        raise ValueError(f"{spec.name} is a {spec.kind}, not a histogram")
    return spec.buckets or token_count_buckets(max_model_len)
