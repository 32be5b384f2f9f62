"""Admission control with two ingress replicas on a real local Ray cluster, over simulated H200
workers with small pools (32 blocks: four 8-block requests each), overloaded by twice the
requests the workers hold at once.

Each ingress refuses from the workers' own numbers (their running requests' remaining steps and
step time, in their KV events), not from guesses of what the other replica sent: no request
waits out the admission maximum; each either completes whole or gets a clean 429 in OpenAI's
error shape; and afterwards both replicas' copies of the view equal the workers' pools.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from pagefleet.router.routing.admission import WAITED_OUT

from cluster_app import assert_views_equal_pools, ingress, start_app, wait_idle

MODEL = "llama-3-8b"
# Served under a name of its own: the session's cluster keeps every app's series, and another module
# counts this model's.
SERVED = "llama-3-8b-admission"
MAX_WAIT_S = 1.0
MAX_TOKENS = 100  # with a 16-token prompt: 116 tokens, 8 blocks
CLIENTS = 16  # twice what the two workers' 32 blocks hold at once
COMPLETIONS = 24  # traffic runs until this many completed


@pytest.fixture(scope="module")
def server(ray_cluster, serve_http_port, tmp_path_factory):
    from ray import serve

    from pagefleet.router.global_scheduler.actor import stop_scheduler
    from pagefleet.worker.simulated.checkpoint import simulated_checkpoint

    from cluster_app import APP

    stop_scheduler()
    simulated_checkpoint(MODEL)  # written here once, not by both ingresses and both workers at once
    # a step of 4 sequences is about 13 ms at a quarter of the roofline: a request runs 1-2 s
    yield start_app(ray_cluster, serve_http_port, MODEL, tmp_path_factory.mktemp("serve"), simulate="h200",
                    simulate_efficiency=0.25, kv_cache_bytes="64MiB", ingress_replicas=2,
                    admission_max_wait_s=MAX_WAIT_S, served_model_name=SERVED)
    serve.delete(APP)
    stop_scheduler()


async def overload(base: str) -> list[tuple[int, dict, str | None, float]]:
    """``CLIENTS`` clients each sending one request after another (after a 429, 0.2 s later) until
    ``COMPLETIONS`` completed: (status, body, Retry-After, seconds to the answer) of each."""
    rng = random.Random(0)
    answers: list[tuple[int, dict, str | None, float]] = []

    async def client(http: httpx.AsyncClient) -> None:
        while sum(status == 200 for status, *_ in answers) < COMPLETIONS:
            body = {"model": SERVED, "prompt": [rng.randrange(5, 30_000) for _ in range(16)],
                    "max_tokens": MAX_TOKENS, "ignore_eos": True}
            started = time.monotonic()
            r = await http.post(f"{base}/v1/completions", json=body)
            answers.append((r.status_code, r.json(), r.headers.get("retry-after"), time.monotonic() - started))
            if r.status_code == 429:
                await asyncio.sleep(0.2)

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))
    return answers


async def warm_up(base: str) -> None:
    """Four short requests at once, so that both workers have timed a step: until one has, an
    ingress has no forecast and a request may wait out its time (routing.md)."""
    async with httpx.AsyncClient(timeout=60) as http:
        rs = await asyncio.gather(*(http.post(f"{base}/v1/completions", json={
            "model": SERVED, "prompt": [5 + i] * 16, "max_tokens": 4, "ignore_eos": True}) for i in range(4)))
    assert [r.status_code for r in rs] == [200] * 4


def test_two_ingress_replicas_refuse_overload_at_once_and_keep_exact_views(server):
    from pagefleet.router.global_scheduler.actor import get_scheduler

    asyncio.run(warm_up(server))
    answers = asyncio.run(overload(server))
    done = [body for status, body, _, _ in answers if status == 200]
    refused = [(body, retry_after, took) for status, body, retry_after, took in answers if status == 429]
    assert len(done) + len(refused) == len(answers)  # nothing but completions and 429s
    assert len(done) >= COMPLETIONS and refused  # it was overloaded
    for body in done:  # each whole
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert [c["finish_reason"] for c in body["choices"]] == ["length"]
    for body, retry_after, _ in refused:  # OpenAI's rate-limit error, with when to come back
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert (body["error"]["type"], body["error"]["code"]) == ("requests", "rate_limit_exceeded")
        assert not body["error"]["message"].startswith(WAITED_OUT)
        assert retry_after is not None and int(retry_after) >= 1
    waits = sorted(took for *_, took in refused)
    print(f"{len(done)} completed, {len(refused)} refused; 429 answered in p50 {waits[len(waits) // 2]:.3f} s, "
          f"max {waits[-1]:.3f} s")

    wait_idle()
    # every replica's counters, from calls that reach each in turn
    counters = {}
    deadline = time.monotonic() + 30
    while len(counters) < 2:
        answer = ingress().counters.remote().result()
        counters[answer.replica_id] = answer.admission
        assert time.monotonic() < deadline, f"only replicas {sorted(counters)} answered"
    print({rid: c for rid, c in counters.items()})
    assert [c.rejected_waited_too_long for c in counters.values()] == [0, 0]  # nobody waited out the maximum
    assert sum(c.rejected_expected_wait for c in counters.values()) > 0  # refused from the forecast
    # each replica's copy of the view equals the workers' pools after the traffic
    views = assert_views_equal_pools(get_scheduler(), ingress_replicas=2)
    assert [v.num_total_blocks for v in views.values()] == [32, 32]
