"""pagefleet_http_requests counts every response by route and status code (no Ray: a recording fake)."""

from collections import Counter

from fastapi.testclient import TestClient

from pagefleet.router.metrics import ROUTER_METRICS, RouterMetrics
from pagefleet.router.openai.app import build_openai_app

from serving_fakes import MODEL


class RecordingMetrics(RouterMetrics):
    def __init__(self):
        super().__init__()
        self.enabled = False  # never touch Ray here, even inside a test session that started it
        self.counts: Counter = Counter()

    def inc(self, key, value=1.0, **tags):
        super().inc(key, value, **tags)  # checks the key against the table
        self.counts[(key, tags["route"], tags["status_code"])] += value


def test_responses_are_counted_by_route_and_status(service):
    metrics = RecordingMetrics()
    with TestClient(build_openai_app(service, api_key="k", metrics=metrics)) as client:
        auth = {"Authorization": "Bearer k"}
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=body, headers=auth).status_code == 200
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=auth) as r:
            assert r.status_code == 200 and list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
        assert client.post("/v1/completions", json={**body, "max_tokens": -1}, headers=auth).status_code == 400
        assert client.post("/v1/completions", json=body).status_code == 401
        assert client.post("/v1/completions", json={**body, "model": "nope"}, headers=auth).status_code == 404
        assert client.get("/v1/models", headers=auth).status_code == 200
        assert client.get("/no/such/route", headers=auth).status_code == 404
        assert client.get("/no/such/route").status_code == 401  # no route is probed without the key
        assert client.get("/version").status_code == 200
    assert metrics.counts == Counter({
        ("http_requests", "/v1/completions", "200"): 2,
        ("http_requests", "/v1/completions", "400"): 1,
        ("http_requests", "/v1/completions", "401"): 1,
        ("http_requests", "/v1/completions", "404"): 1,
        ("http_requests", "/v1/models", "200"): 1,
        ("http_requests", "other", "404"): 1,
        ("http_requests", "other", "401"): 1,
        ("http_requests", "/version", "200"): 1,
    })


def test_router_metrics_refuse_keys_outside_the_table():
    import pytest

    metrics = RecordingMetrics()
    assert set(ROUTER_METRICS) == {"http_requests", "routing_decisions", "routing_seconds",
                                   "prefix_hit_blocks_predicted", "prefix_hit_blocks_realised",
                                   "delta_channels_opened", "delta_channel_socket_failures", "worker_resends",
                                   "failovers", "admission_queue_length", "admission_wait_seconds",
                                   "admission_rejections"}
    with pytest.raises(KeyError):
        metrics.set("http_requests", 1.0)  # a counter, not a gauge
    with pytest.raises(KeyError):
        metrics.observe("no_such_metric", 1.0)


class ZeroedMetrics(RecordingMetrics):
    """Records which counter series start at 0 (``start_at_zero``) instead of making them in Ray."""

    def __init__(self):
        super().__init__()
        self.zeroed: set[tuple] = set()

    def start_at_zero(self, key, *tag_sets):
        super().start_at_zero(key, *tag_sets)  # checks the key is a counter of the table
        self.zeroed |= {(key, *sorted(tags.items())) for tags in tag_sets or ({},)}


def test_the_ingress_counters_the_dashboard_plots_start_at_zero(service):
    from pagefleet.router.global_scheduler.kv_mirror import SchedulerMirror
    from pagefleet.router.routing.admission import REJECTION_REASONS
    from pagefleet.router.routing.kv_routing import KV_REASONS, KVRoutingClient, KVRoutingOptions

    metrics = ZeroedMetrics()
    build_openai_app(service, metrics=metrics)
    assert metrics.zeroed == {("http_requests", ("route", route), ("status_code", status))
                              for route in ("/v1/completions", "/v1/chat/completions") for status in ("200", "429")}
    metrics = ZeroedMetrics()
    KVRoutingClient(SchedulerMirror(4.0), KVRoutingOptions(), block_size=16, metrics=metrics)
    assert metrics.zeroed == (
        {("routing_decisions", ("policy", "kv"), ("reason", r)) for r in KV_REASONS}
        | {("admission_rejections", ("reason", r)) for r in (*REJECTION_REASONS, "worker_queue_full")}
        | {("prefix_hit_blocks_predicted",), ("prefix_hit_blocks_realised",)})
    assert KV_REASONS == ("prefix", "load", "no_room", "fallback_stale", "fallback_no_view")
