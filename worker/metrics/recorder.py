"""Records engine metric batches with ``ray.util.metrics`` (a Ray adapter file of worker/).

One ``ray.util.metrics`` object per ``MetricSpec``, created once per process
with the replica's tags as defaults, each counter's series at 0 from the start
(``start_at_zero``). ``record`` takes a whole
``EngineMetricsBatch`` (a flush interval's worth of steps): one ``inc`` per
counter, one ``set`` per gauge, one ``observe`` per histogram sample. Ray's
core worker aggregates them and its node's metrics agent exports them.
"""

from __future__ import annotations

from typing import Any, Mapping

from pagefleet.worker.metrics.collector import EngineMetricsBatch
from pagefleet.worker.metrics.definitions import ENGINE_METRICS, FINISH_REASONS, MetricSpec, histogram_buckets


def make_ray_metric(spec: MetricSpec, default_tags: Mapping[str, str], max_model_len: int = 0) -> Any:
    from ray.util import metrics

    if spec.kind == "counter":
        metric = metrics.Counter(spec.name, spec.description, tag_keys=spec.tag_keys)
    elif spec.kind == "gauge":
        metric = metrics.Gauge(spec.name, spec.description, tag_keys=spec.tag_keys)
    else:
        metric = metrics.Histogram(spec.name, spec.description, boundaries=list(histogram_buckets(spec, max_model_len)),
                                   tag_keys=spec.tag_keys)
    return metric.set_default_tags(dict(default_tags))


def start_at_zero(counter: Any, tags: Mapping[str, str] | None = None) -> None:
    """Make a ``ray.util.metrics.Counter``'s series for ``tags`` (over its defaults) exist at 0, so
    it is there from the first scrape, as vLLM's labelled counters are and as dashboards expect
    (a rate over a missing series is no data, not 0). Ray's ``inc`` refuses 0; recording a 0
    point is what makes the series."""
    counter._record(0, tags=dict(tags) if tags else None)


class RayEngineMetricsRecorder:
    def __init__(self, model_name: str, replica: str, max_model_len: int) -> None:
        tags = {"model_name": model_name, "replica": replica}
        self._metrics = {key: make_ray_metric(spec, tags, max_model_len) for key, spec in ENGINE_METRICS.items()}
        for key, spec in ENGINE_METRICS.items():
            if spec.kind != "counter":
                continue
            if "finished_reason" in spec.tag_keys:
                for reason in FINISH_REASONS:
                    start_at_zero(self._metrics[key], {"finished_reason": reason})
            else:
                start_at_zero(self._metrics[key])

    def record(self, batch: EngineMetricsBatch) -> None:
        for key, metric in self._metrics.items():
            value = getattr(batch, key)
            kind = ENGINE_METRICS[key].kind
            if kind == "gauge":
                metric.set(value)
            elif kind == "histogram":
                for sample in value:
                    metric.observe(sample)
            elif isinstance(value, dict):  # a counter by finish reason
                for reason, count in value.items():
                    metric.inc(count, tags={"finished_reason": reason})
            elif value:
                metric.inc(value)
