"""Metrics end to end: a two-replica pagefleet on the session's Ray cluster, scraped by a real
Prometheus (Debian's package) through Ray's service-discovery file with deploy/prometheus/prometheus.yml;
counters checked exactly against the responses, every dashboard query evaluated.

Without a `prometheus` binary these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from pagefleet.worker.metrics.definitions import ENGINE_METRICS
from pagefleet.worker.metrics.stats import ReplicaStats

from cluster_helpers import wait_until_running
from conftest import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _prometheus import dashboard_queries, queries_without_data, query, running_prometheus

ROOT = Path(__file__).resolve().parents[2]
APP = "pagefleet"
MAX_MODEL_LEN = 256


def _prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        message = "no `prometheus` binary (scripts/install.sh installs Debian's package)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def replica_ids() -> list[str]:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and "PagefleetWorker" in a["name"]]
    stats = ray.get([ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names], timeout=60)
    return sorted(ReplicaStats.from_routing_stats(s).replica_id for s in stats)


@pytest.fixture(scope="module")
def prometheus(ray_temp_dir, tmp_path_factory):
    """deploy/prometheus/prometheus.yml over this session's Ray cluster, scraping each second."""
    with running_prometheus(_prometheus_binary(), tmp_path_factory.mktemp("prometheus"), free_port(),
                            ray_temp_dir=ray_temp_dir) as base:
        yield base


@pytest.fixture(scope="module")
def app(ray_cluster, serve_http_port, tiny_checkpoint, tmp_path_factory):
    from ray import serve

    ckpt = tiny_checkpoint("llama")
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    config["http_options"]["port"] = serve_http_port
    # A KV pool of 24 blocks (16 KiB each for this model) per replica: 8 long requests on a replica
    # need more, so the traffic below preempts (and recomputed prompts hit the prefix cache). That
    # needs a policy without admission control: kv routing would hold the excess back instead.
    config["applications"][0]["args"].update(model=str(ckpt), workers=2, kv_cache_bytes=24 * 16 * 2**10,
                                             max_model_len=MAX_MODEL_LEN, max_num_seqs=8, worker_num_cpus=0.5,
                                             ingress_num_cpus=0.25, routing="least_loaded")
    path = tmp_path_factory.mktemp("serve-metrics") / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = str(Path(sys.executable).parent / "serve")
    done = subprocess.run([serve_cli, "run", "--address", ray_cluster, "--non-blocking", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    wait_until_running(APP)
    base = f"http://127.0.0.1:{serve_http_port}"
    yield base, ckpt.name, replica_ids()
    serve.delete(APP)


def _counters(prom: str, replicas: list[str]) -> dict:
    sel = 'replica=~"%s"' % "|".join(replicas)
    out = {}
    for name in ("generation_tokens", "prompt_tokens", "num_preemptions"):
        rows = query(prom, f"sum(ray_pagefleet_{name}_total{{{sel}}})")
        out[name] = float(rows[0]["value"][1]) if rows else 0.0
    rows = query(prom, f"sum by (finished_reason) (ray_pagefleet_request_success_total{{{sel}}})")
    out["finished"] = {r["metric"]["finished_reason"]: float(r["value"][1]) for r in rows}
    rows = query(prom, 'sum by (route, status_code) (ray_pagefleet_http_requests_total{route=~"/v1/.*"})')
    out["http"] = {(r["metric"]["route"], r["metric"]["status_code"]): float(r["value"][1]) for r in rows}
    return out


def _settled(prom: str, replicas: list[str], timeout_s: float = 60.0) -> dict:
    """Counters once two reads 3 s apart agree (the engines flush each second, Ray's agents export
    each second here, Prometheus scrapes each second)."""
    deadline = time.monotonic() + timeout_s
    last = _counters(prom, replicas)
    while True:
        time.sleep(3)
        now = _counters(prom, replicas)
        if now == last and sum(now["finished"].values()):
            return now
        assert time.monotonic() < deadline, f"counters still moving: {last} -> {now}"
        last = now


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            diff = {k: v - before[key].get(k, 0.0) for k, v in value.items()}
            out[key] = {k: v for k, v in diff.items() if v}
        else:
            out[key] = value - before[key]
    return out


@pytest.fixture(scope="module")
def traffic(app, prometheus):
    """A known batch of requests; returns what the responses reported and the counters' growth."""
    import openai

    base, model, replicas = app
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    deadline = time.monotonic() + 60
    while not query(prometheus, 'up{job="ray"} == 1'):  # discovery found the agents
        assert time.monotonic() < deadline, "Prometheus found no Ray target to scrape"
        time.sleep(1)
    # One request first, so the series exist before the baseline is read.
    client.completions.create(model=model, prompt="warm up", max_tokens=2, temperature=0)
    before = _settled(prometheus, replicas)

    def long_one(i):
        return client.completions.create(model=model, prompt=f"request number {i} of sixteen", max_tokens=80,
                                         temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(long_one, range(16)))
    # The same prompt of several full KV blocks three times, one after another: two of them land on
    # one of the two replicas, and the later one finds the prompt cached there (a prefix cache hit
    # whatever the preemptions above did).
    shared = " ".join(["a shared prompt that fills whole blocks of the cache"] * 6)
    for _ in range(3):
        responses.append(client.completions.create(model=model, prompt=shared, max_tokens=2, temperature=0))
    full = client.completions.create(model=model, prompt="Hello, my name is", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
    stop = full.choices[0].text[6:9]
    responses.append(full)
    responses.append(client.completions.create(model=model, prompt="Hello, my name is", max_tokens=16,
                                               temperature=0, stop=[stop], extra_body={"ignore_eos": True}))
    responses.append(client.completions.create(model=model, prompt="two at once", max_tokens=5, n=2, seed=7,
                                               temperature=1.0))
    responses.append(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=6, temperature=0))
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Stream"}],
                                            max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1}).status_code == 400
    assert httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404

    usage = [r.usage for r in responses] + [chunks[-1].usage]
    reasons = Counter(c.finish_reason for r in responses for c in r.choices)
    reasons.update(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    reported = {
        "generation_tokens": sum(u.completion_tokens for u in usage),
        "prompt_tokens": sum(u.prompt_tokens for u in usage),
        "finished": dict(reasons),
        "http": {("/v1/completions", "200"): 22.0, ("/v1/chat/completions", "200"): 2.0,
                 ("/v1/completions", "400"): 1.0, ("/v1/completions", "404"): 1.0},
    }
    after = _settled(prometheus, replicas)
    return reported, _delta(after, before)


def test_engine_and_http_counters_are_scraped_at_zero_before_any_request(app, prometheus):
    """As vLLM's: every engine counter of each replica (request_success for each finish reason) and
    the ingress's http_requests for what the dashboard plots, from the first scrape at 0. (The
    routing decisions of least_loaded start at 0 when Serve makes its request router, at the
    first request; latency histograms appear with their first observation.)"""
    base, model, replicas = app
    sel = 'replica=~"%s"' % "|".join(replicas)
    counters = [s.exported for s in ENGINE_METRICS.values() if s.kind == "counter"]
    deadline = time.monotonic() + 60
    while True:
        rows = {name: query(prometheus, f"{name}{{{sel}}}") for name in counters}
        http = query(prometheus, f'ray_pagefleet_http_requests_total{{model_name="{model}", status_code="429"}}')
        if all(rows.values()) and http or time.monotonic() > deadline:
            break
        time.sleep(1)
    per_replica = {name: sorted(r["metric"]["replica"] for r in found) for name, found in rows.items()}
    success = per_replica.pop("ray_pagefleet_request_success_total")
    assert per_replica == {name: replicas for name in per_replica}, per_replica
    assert success == sorted(replicas * 3)  # stop, length and abort
    assert all(float(r["value"][1]) == 0 for found in rows.values() for r in found)
    assert sorted(r["metric"]["route"] for r in http) == ["/v1/chat/completions", "/v1/completions"]
    assert all(float(r["value"][1]) == 0 for r in http)


def test_exported_counters_equal_what_the_responses_reported(traffic):
    reported, grown = traffic
    assert reported["finished"]["stop"] >= 1 and reported["finished"]["length"] >= 17  # both reasons exercised
    assert grown["generation_tokens"] == reported["generation_tokens"]
    assert grown["prompt_tokens"] == reported["prompt_tokens"]
    assert grown["finished"] == {k: float(v) for k, v in reported["finished"].items()}
    assert grown["http"] == reported["http"]
    assert grown["num_preemptions"] > 0  # the small KV pool made the engines preempt


def test_every_dashboard_query_returns_data(traffic, prometheus):
    assert not queries_without_data(prometheus)


def test_dashboard_series_are_all_exported(traffic, prometheus):
    named = {n for _, expr in dashboard_queries() for n in re.findall(r"\bray_pagefleet_\w+", expr)}
    deadline = time.monotonic() + 30
    while True:  # series names Prometheus has seen; a busy agent may export a gauge a scrape late
        exported = {r for r in httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=30).json()["data"]
                    if r.startswith("ray_pagefleet_")}
        if named <= exported or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert named <= exported, named - exported


def test_metrics_endpoint_on_the_serve_port_shows_the_pagefleet_series(app, traffic):
    base, model, replicas = app
    text = httpx.get(f"{base}/metrics", timeout=30).text
    for replica in replicas:
        assert f'replica="{replica}"' in text
    for series in ("ray_pagefleet_generation_tokens_total{", "ray_pagefleet_num_requests_running{",
                   "ray_pagefleet_time_to_first_token_seconds_bucket{", "ray_pagefleet_http_requests_total{"):
        assert series in text, series
    assert "python_gc_objects_collected_total" in text  # the ingress process's own series stay
    # every delta channel went over a TCP connection to its replica, none fell back to a Serve stream
    opened = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'ray_pagefleet_router_delta_channels_opened_total\{[^}]*transport="(\w+)"[^}]*\} (\S+)', text)}
    assert opened["socket"] >= 1 and opened["serve_stream"] == 0  # its series is there from the start, at 0
