"""The metric table (names, buckets, docs) and the per-step collector, without Ray or torch."""

import re
from pathlib import Path

import pytest

from pagefleet.router.metrics import ROUTER_METRICS
from pagefleet.router.openai.node_metrics import pagefleet_families
from pagefleet.router.routing.policies import ReplicaLoad, replica_load, routing_reason
from pagefleet.worker.metrics.collector import EngineMetricsBatch, EngineMetricsCollector
from pagefleet.worker.metrics.definitions import ENGINE_METRICS, MetricSpec, histogram_buckets, token_count_buckets
from pagefleet.worker.metrics.stats import EngineStats
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_names_are_vllms_with_pagefleet_and_rays_export_prefix():
    exported = {s.vllm_name: s.exported for s in ENGINE_METRICS.values()}
    assert exported["vllm:num_requests_running"] == "ray_pagefleet_num_requests_running"
    assert exported["vllm:generation_tokens"] == "ray_pagefleet_generation_tokens_total"
    assert exported["vllm:request_success"] == "ray_pagefleet_request_success_total"
    assert exported["vllm:time_to_first_token_seconds"] == "ray_pagefleet_time_to_first_token_seconds"
    for spec in ENGINE_METRICS.values():
        assert spec.vllm_name.replace("vllm:", "pagefleet_") == spec.name
        assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", spec.name)  # what Ray's metric API accepts
        assert spec.tag_keys[:2] == ("model_name", "replica")
    with pytest.raises(ValueError):
        MetricSpec("vllm:x", "counter", "")
    with pytest.raises(ValueError):
        MetricSpec("pagefleet_x", "summary", "")


def test_buckets_are_vllms():
    assert token_count_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_count_buckets(1) == (1,)
    assert histogram_buckets(ENGINE_METRICS["ttft"], 2048)[:3] == (0.001, 0.005, 0.01)
    assert histogram_buckets(ENGINE_METRICS["ttft"], 2048)[-1] == 2560.0
    assert histogram_buckets(ENGINE_METRICS["itl"], 2048)[-1] == 80.0
    assert histogram_buckets(ENGINE_METRICS["e2e"], 2048) == histogram_buckets(ENGINE_METRICS["queue_time"], 9)
    assert histogram_buckets(ENGINE_METRICS["request_prompt_tokens"], 256)[-1] == 200.0
    with pytest.raises(ValueError):
        histogram_buckets(ENGINE_METRICS["num_running"], 256)


def test_docs_table_lists_exactly_the_exported_series():
    text = DOCS.read_text()
    table = text.split("<!-- metrics-table:begin -->")[1].split("<!-- metrics-table:end -->")[0]
    documented = re.findall(r"^\| `(ray_pagefleet_\w+)` \| (\w+) \|", table, flags=re.M)
    specs = list(ENGINE_METRICS.values()) + list(ROUTER_METRICS.values())
    assert documented == [(s.exported, s.kind) for s in specs]


def test_every_batch_field_has_a_metric():
    assert set(EngineMetricsBatch.__dataclass_fields__) == set(ENGINE_METRICS)


def _stats(**kw) -> EngineStats:
    base = dict(num_total_blocks=100, num_free_blocks=100, num_running=0, num_waiting=0, prefix_cache_queries=0,
                prefix_cache_hits=0, num_preemptions=0, num_steps=0, prompt_tokens_total=0,
                generation_tokens_total=0)
    base.update(kw)
    return EngineStats(**base)


def _delta(rid, tokens_per_seq, finish=None, prompt=7, finished=False):
    seqs = [CompletionOutput(i, "", list(range(n)), None, finish[i] if finish else None)
            for i, n in enumerate(tokens_per_seq)]
    return RequestOutputDelta(rid, seqs, prompt, 0, finished)


def test_collector_turns_steps_into_one_batch():
    c = EngineMetricsCollector(_stats(prompt_tokens_total=5, generation_tokens_total=9))  # counts before it
    c.add_request("a", now=10.0)
    c.add_request("b", now=10.5)
    c.scheduled(["a"], now=11.0)
    c.step(11.5, _stats(num_running=1, num_waiting=1, num_free_blocks=90, prompt_tokens_total=19,
                        generation_tokens_total=10, prefix_cache_queries=14, prefix_cache_hits=4),
           [_delta("a", [1])])
    c.scheduled(["a", "b"], now=12.0)
    c.step(12.25, _stats(num_running=2, num_free_blocks=75, prompt_tokens_total=19, generation_tokens_total=13,
                         num_preemptions=1, prefix_cache_queries=14, prefix_cache_hits=4),
           [_delta("a", [1], ["length"], finished=True), _delta("b", [1, 1])])
    batch = c.take()
    assert (batch.num_running, batch.num_waiting, batch.kv_cache_usage) == (2, 0, 0.25)
    assert (batch.prompt_tokens, batch.generation_tokens, batch.preemptions) == (14, 4, 1)
    assert (batch.prefix_cache_queries, batch.prefix_cache_hits) == (14, 4)
    assert batch.queue_time == [1.0, 1.5]       # a: 10 -> 11, b: 10.5 -> 12 (a's second schedule ignored)
    assert batch.ttft == [1.5, 1.75]             # a at 11.5, b at 12.25
    assert batch.itl == [0.75]                   # a: 11.5 -> 12.25
    assert batch.e2e == [2.25]                   # a: 10 -> 12.25
    assert batch.finished == {"length": 1}
    assert (batch.request_prompt_tokens, batch.request_generation_tokens) == ([7], [2])
    assert c.num_tracked == 1                    # b is still running

    c.step(13.0, _stats(num_running=0, num_free_blocks=100, prompt_tokens_total=19, generation_tokens_total=15,
                        num_preemptions=1, prefix_cache_queries=14, prefix_cache_hits=4),
           [_delta("b", [1, 1], ["stop", "abort"], finished=True)])
    batch = c.take()
    assert (batch.generation_tokens, batch.preemptions, batch.prompt_tokens) == (2, 0, 0)
    assert batch.finished == {"stop": 1, "abort": 1}
    assert (batch.ttft, batch.itl, batch.e2e) == ([], [0.75], [2.5])
    assert batch.request_generation_tokens == [4]
    assert c.num_tracked == 0
    empty = c.take()
    assert (empty.num_running, empty.kv_cache_usage, empty.generation_tokens, empty.itl) == (0, 0.0, 0, [])


def test_routing_reasons():
    a = ReplicaLoad("a", num_running=1, num_free_blocks=10)
    assert routing_reason([a]) == "only_replica"
    assert routing_reason([a, ReplicaLoad("b", num_running=2, num_free_blocks=10)]) == "least_queued"
    assert routing_reason([a, ReplicaLoad("b", num_running=1, num_free_blocks=5)]) == "most_free_blocks"
    assert routing_reason([a, ReplicaLoad("b", num_running=1, num_free_blocks=10)]) == "tie"
    assert routing_reason([a, ReplicaLoad("b", healthy=False)]) == "least_queued"
    assert routing_reason([ReplicaLoad("a", healthy=False)]) == "fallback_unhealthy"
    fresh = replica_load("c", None, num_in_flight=0)
    assert routing_reason([fresh, a]) == "fallback_no_stats"
    with pytest.raises(ValueError):
        routing_reason([])


def test_node_metrics_passes_only_pagefleet_families():
    page = "\n".join([
        "# HELP ray_pagefleet_generation_tokens_total Tokens generated.",
        "# TYPE ray_pagefleet_generation_tokens_total counter",
        'ray_pagefleet_generation_tokens_total{model_name="m",replica="r"} 12.0',
        "# HELP ray_tasks Current number of tasks.",
        "# TYPE ray_tasks gauge",
        'ray_tasks{State="RUNNING"} 3.0',
        'ray_pagefleet_num_requests_running{model_name="m",replica="r"} 2.0',
    ])
    assert pagefleet_families(page).splitlines() == [
        "# HELP ray_pagefleet_generation_tokens_total Tokens generated.",
        "# TYPE ray_pagefleet_generation_tokens_total counter",
        'ray_pagefleet_generation_tokens_total{model_name="m",replica="r"} 12.0',
        'ray_pagefleet_num_requests_running{model_name="m",replica="r"} 2.0',
    ]
    assert pagefleet_families("# HELP ray_tasks x\nray_tasks 1\n") == ""
