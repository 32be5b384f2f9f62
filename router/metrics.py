"""Router and ingress metrics: their names (one table with the engine's) and a small recording API.

``ROUTER_METRICS`` is the table; ``RouterMetrics`` records any of its entries
by key through ``ray.util.metrics``, so a new router series (the global
scheduler's admission queue, predicted and realised prefix hits, ...) is one
entry here and one call where it happens. Outside a Ray worker process (unit
tests with a FastAPI test client) nothing is recorded.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from pagefleet.worker.metrics.definitions import MetricSpec

logger = logging.getLogger(__name__)

ROUTER_METRICS: dict[str, MetricSpec] = {
    "http_requests": MetricSpec(
        "pagefleet_http_requests", "counter", "HTTP requests answered by the ingress, by route and status code.",
        tag_keys=("model_name", "route", "status_code")),
    "routing_decisions": MetricSpec(
        "pagefleet_router_decisions", "counter",
        "Replica choices of the request router, by policy and reason (fallback_* reasons: the policy could "
        "not rank on fresh load and fell back).", tag_keys=("policy", "reason")),
    # kv routing (the global scheduler), recorded by the ingress
    "routing_seconds": MetricSpec(
        "pagefleet_router_choose_seconds", "histogram",
        "kv routing: time to rank the workers for a request with this ingress's copy of the global "
        "scheduler's view (a local computation).",
        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1), tag_keys=("model_name",)),
    "prefix_hit_blocks_predicted": MetricSpec(
        "pagefleet_router_prefix_hit_blocks_predicted", "counter",
        "kv routing: prompt blocks the global scheduler expected the chosen worker to hold.",
        tag_keys=("model_name",)),
    "prefix_hit_blocks_realised": MetricSpec(
        "pagefleet_router_prefix_hit_blocks_realised", "counter",
        "kv routing: prompt blocks the worker the request ran on found in its prefix cache.",
        tag_keys=("model_name",)),
    "delta_channels_opened": MetricSpec(
        "pagefleet_router_delta_channels_opened", "counter",
        "Delta channels this ingress opened to worker replicas, by transport (socket: a TCP connection to "
        "the replica; serve_stream: the replica's socket could not be used, a Serve stream carries the "
        "channel). A channel closes after a few seconds without requests there.",
        tag_keys=("transport",)),
    "delta_channel_socket_failures": MetricSpec(
        "pagefleet_router_delta_channel_socket_failures", "counter",
        "Delta channel sockets of worker replicas this ingress could not use, by reason (connect: no "
        "connection within the timeout; dropped: the replica closed it before answering, as it does when "
        "strangers hold its waiting slots). The replica's channel then goes on a Serve stream for a minute.",
        tag_keys=("reason",)),
    "failovers": MetricSpec(
        "pagefleet_router_failovers", "counter",
        "Requests whose worker replica failed after their output started, continued on another replica "
        "from the tokens they had generated, by reason (worker_failed).",
        tag_keys=("reason",)),
    "worker_resends": MetricSpec(
        "pagefleet_router_worker_resends", "counter",
        "Requests the ingress sent to a worker again before any of their output reached the client, by "
        "reason (worker_failed: the worker replica failed or was unavailable; each is one of the request's "
        "few attempts; connection_lost: the channel connection it was sent on ended first, not an attempt).",
        tag_keys=("reason",)),
    "admission_queue_length": MetricSpec(
        "pagefleet_router_admission_queue_length", "gauge",
        "kv routing: requests waiting at this ingress for a worker with room.", tag_keys=("model_name",)),
    "admission_wait_seconds": MetricSpec(
        "pagefleet_router_admission_wait_seconds", "histogram",
        "kv routing: time a request waited in the admission queue (admitted or refused).",
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), tag_keys=("model_name",)),
    "admission_rejections": MetricSpec(
        "pagefleet_router_admission_rejections", "counter",
        "kv routing: requests answered 429 by admission control, by reason (queue_full, expected_wait, "
        "waited_too_long; worker_queue_full: Serve's queue of a worker replica).",
        tag_keys=("model_name", "reason")),
}


class RouterMetrics:
    """Records ``ROUTER_METRICS`` entries by key; ``enabled`` is False outside a Ray worker."""

    def __init__(self, specs: dict[str, MetricSpec] = ROUTER_METRICS, default_tags: dict[str, str] | None = None):
        self._specs = specs
        self._metrics: dict[str, Any] = {}
        self.enabled = _in_ray_worker()
        if self.enabled:
            from pagefleet.worker.metrics.recorder import make_ray_metric

            for key, spec in specs.items():
                tags = {k: v for k, v in (default_tags or {}).items() if k in spec.tag_keys}
                self._metrics[key] = make_ray_metric(spec, tags)

    def inc(self, key: str, value: float = 1.0, **tags: str) -> None:
        self._check(key, "counter")
        if self.enabled and value > 0:
            self._metrics[key].inc(value, tags=tags or None)

    def start_at_zero(self, key: str, *tag_sets: Mapping[str, str]) -> None:
        """A counter's series for each of ``tag_sets`` (none: its default tags alone) at 0 from now,
        so they exist from the first scrape (``recorder.start_at_zero``)."""
        self._check(key, "counter")
        if self.enabled:
            from pagefleet.worker.metrics.recorder import start_at_zero

            for tags in tag_sets or ({},):
                start_at_zero(self._metrics[key], tags)

    def set(self, key: str, value: float, **tags: str) -> None:
        self._check(key, "gauge")
        if self.enabled:
            self._metrics[key].set(value, tags=tags or None)

    def observe(self, key: str, value: float, **tags: str) -> None:
        self._check(key, "histogram")
        if self.enabled:
            self._metrics[key].observe(value, tags=tags or None)

    def _check(self, key: str, kind: str) -> None:
        spec = self._specs.get(key)
        if spec is None or spec.kind != kind:
            raise KeyError(f"no {kind} {key!r} in the router metrics table")


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
