"""`pagefleet serve --simulate h200 --model llama-3-8b --workers 2` on a real local Ray cluster:
the shipped serve.yaml with the simulated GPU, served through the OpenAI API. The workers' pools
are the plan's 56,808 blocks, their KV events the real ones (0 drift after traffic), and a
stream takes at least the roofline's time per step."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from pagefleet.worker.simulated.presets import GPUS

from cluster_app import assert_views_equal_pools, start_app, traffic, wait_idle, worker_snapshots

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-3-8b"
# A Llama-3-8B decode step reads at least its weights (all but the embedding table, bf16).
MIN_STEP_S = (2 * 8_030_261_248 - 2 * 128256 * 4096) / GPUS["h200"].bandwidth


@pytest.fixture(scope="module")
def server(ray_cluster, serve_http_port, tmp_path_factory):
    from ray import serve

    from pagefleet.router.global_scheduler.actor import stop_scheduler
    from pagefleet.worker.simulated.checkpoint import simulated_checkpoint

    from cluster_app import APP

    stop_scheduler()
    simulated_checkpoint(MODEL)  # written here once, not by the ingress and both workers at once
    yield start_app(ray_cluster, serve_http_port, MODEL, tmp_path_factory.mktemp("serve"), simulate="h200",
                    kv_cache_bytes=None)
    serve.delete(APP)
    stop_scheduler()


def _samples(text: str) -> dict[str, list[tuple[str, float]]]:
    """Each pagefleet series on a Prometheus text page, of this module's model where the series names
    one (the session's cluster keeps the series of the apps other modules ran): name -> [(its
    labels, its value)]."""
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(ray_pagefleet_\w+)\{(.*)\} (\S+)", line)
        if match and ("model_name=" not in match.group(2) or f'model_name="{MODEL}"' in match.group(2)):
            out.setdefault(match.group(1), []).append((match.group(2), float(match.group(3))))
    return out


def test_every_counter_and_gauge_the_dashboard_names_is_there_before_any_request(server):
    """Counters start at 0, as vLLM's do, each engine's for its finish reasons and the ingress's for
    the routes and kv routing reasons the dashboard plots. (The latency histograms have no series
    before their first observation: Ray makes none without one.)"""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "pagefleet.json").read_text())
    named = {n for p in dashboard["panels"] for t in p["targets"] for n in re.findall(r"\bray_pagefleet_\w+", t["expr"])}
    wanted = {n for n in named if not n.endswith("_bucket")}
    deadline = time.monotonic() + 30
    while True:  # the agent exports what each process recorded every second here
        samples = _samples(httpx.get(f"{server}/metrics", timeout=30).text)
        if wanted <= set(samples) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert wanted <= set(samples), wanted - set(samples)
    # This app's workers: the exporter keeps the series of stopped replicas of the same model
    # (an earlier module's, or one Serve scaled down) for a while.
    live = [f'replica="{worker_id}"' for worker_id in worker_snapshots()]

    def ours(name: str) -> list[tuple[str, float]]:
        return [(labels, value) for labels, value in samples[name] if any(r in labels for r in live)]

    for name in ("ray_pagefleet_num_preemptions_total", "ray_pagefleet_prefix_cache_hits_total"):
        assert len(ours(name)) == 2 and all(value == 0 for _, value in ours(name))  # one per worker
    reasons = [labels for labels, value in ours("ray_pagefleet_request_success_total") if value == 0]
    assert sum('finished_reason="abort"' in labels for labels in reasons) == 2
    decisions = {labels for labels, value in samples["ray_pagefleet_router_decisions_total"] if value == 0}
    assert any('policy="kv"' in labels and 'reason="prefix"' in labels for labels in decisions)
    http = [labels for labels, value in samples["ray_pagefleet_http_requests_total"] if value == 0]
    assert any('route="/v1/chat/completions"' in labels and 'status_code="429"' in labels for labels in http)


def test_the_openai_api_over_simulated_workers(server):
    assert [m["id"] for m in httpx.get(f"{server}/v1/models", timeout=30).json()["data"]] == [MODEL]
    body = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 16, "ignore_eos": True, "n": 2, "seed": 3}
    first = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["completion_tokens"] == 32
    assert [c["finish_reason"] for c in first["choices"]] == ["length", "length"]
    again = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in first["choices"]]
    assert first["choices"][0]["text"] != first["choices"][1]["text"]


def test_a_stream_takes_at_least_a_roofline_step_per_token(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    took = time.perf_counter() - started
    assert lines[-1] == "data: [DONE]"
    assert took >= 32 * MIN_STEP_S  # the prefill and 31 decodes, each reading the weights at least


def test_zero_drift_of_the_schedulers_view_after_traffic(server):
    from pagefleet.router.global_scheduler.actor import get_scheduler

    statuses = asyncio.run(traffic(server, MODEL, 200, seed=0))
    assert statuses == [200] * 200
    wait_idle()
    views = assert_views_equal_pools(get_scheduler())
    assert [v.num_total_blocks for v in views.values()] == [56_808, 56_808]  # the plan's pool for an H200
    assert all(v.routing_keys for v in views.values())
