"""The HTTP client of ``routing.py`` and its readings of the workers' own counters.

aiohttp (the client of `pagefleet bench` and `vllm bench serve`), streaming completions with
token-id prompts, one ``cache_salt`` per tenant; a result per request, with its TTFT, the gaps
between its streamed chunks and how a refusal read.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from pagefleet.router.routing.admission import WAITED_OUT  # how a 429 after waiting reads


def poisson_arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of ``rate`` per second."""
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


@dataclass
class Result:
    tenant: int
    kind: str = "ok"  # ok | 429 | timeout | error
    status: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    output_tokens: int = 0
    waited: bool = False  # a 429 after waiting out admission's maximum wait (not refused on arrival)
    # Between successive streamed chunks (one engine step's tokens each): the inter-token latency.
    itl_s: list[float] = field(default_factory=list)


@dataclass
class Phase:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    counters_before: dict = field(default_factory=dict)
    counters_after: dict = field(default_factory=dict)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def spread_ms(values: list[float]) -> dict:
    return {"p50": ms(pct(values, 0.5)), "p99": ms(pct(values, 0.99)), "max": ms(max(values)) if values else None}


def ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 1)


NO_TIMEOUT = aiohttp.ClientTimeout(total=None)  # each request has its own asyncio.timeout


async def one_request(http: aiohttp.ClientSession, base: str, model: str, tenant: int, prompt: list[int],
                      timeout_s: float, max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": f"tenant-{tenant}"}
    result = Result(tenant)
    started = last = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(f"{base}/v1/completions", json=body) as r:
                result.status = r.status
                if r.status != 200:
                    text = await r.text()
                    result.kind = "429" if r.status == 429 else "error"
                    result.waited = WAITED_OUT in text
                else:
                    async for raw in r.content:  # one SSE line at a time
                        line = raw.decode().rstrip("\r\n")
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            now = time.perf_counter()
                            if result.ttft_s is None:
                                result.ttft_s = now - started
                            else:
                                result.itl_s.append(now - last)
                            last = now
                        if chunk.get("usage"):
                            result.output_tokens = chunk["usage"]["completion_tokens"]
    except TimeoutError:
        result.kind = "timeout"
    except aiohttp.ClientError:
        result.kind = "error"
    result.latency_s = time.perf_counter() - started
    return result


async def open_loop(base: str, model: str, work, rate: float, duration_s: float, timeout_s: float,
                    max_tokens: int) -> tuple[list[Result], float]:
    """Poisson arrivals: each request starts at its time whatever the others are doing."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2000), timeout=NO_TIMEOUT) as http:
        start = time.perf_counter()
        tasks = []
        for at in work.arrivals(rate, duration_s):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tenant, prompt = work.request()
            tasks.append(asyncio.create_task(one_request(http, base, model, tenant, prompt, timeout_s,
                                                                 max_tokens)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def worker_counters(app: str) -> dict:
    """The workers' own engine counters, summed (asked of every replica actor)."""
    import ray

    from pagefleet.worker.metrics.stats import ReplicaStats

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and f"::{app}#PagefleetWorker#" in a["name"]]
    stats = ray.get([ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names], timeout=60)
    engines = [ReplicaStats.from_routing_stats(s).engine for s in stats]
    return {"replicas": len(engines), "queries": sum(e.prefix_cache_queries for e in engines),
            "hits": sum(e.prefix_cache_hits for e in engines),
            "preemptions": sum(e.num_preemptions for e in engines),
            "busy": sum(e.num_running + e.num_waiting for e in engines),
            "blocks_per_worker": sorted({e.num_total_blocks for e in engines})}


def wait_idle(app: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while worker_counters(app)["busy"] and time.monotonic() < deadline:
        time.sleep(0.5)


def run_phase(app: str, base: str, model: str, work, rate: float, duration_s: float, timeout_s: float,
              max_tokens: int) -> Phase:
    """``work``: a workload (``arrivals``, ``request``); counters read before and after, idle."""
    phase = Phase(counters_before=worker_counters(app))
    phase.results, phase.wall_s = asyncio.run(open_loop(base, model, work, rate, duration_s, timeout_s,
                                                        max_tokens))
    wait_idle(app)
    phase.counters_after = worker_counters(app)
    return phase

