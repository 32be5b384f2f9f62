"""``routing.py --simulate GPU``: the routing policies across a fleet of simulated GPU workers.

The workload is multi-tenant chat: each tenant has a long system prompt of its own (its own
``cache_salt``) that every one of its requests starts with, then a short unique turn, and a
short answer (short, so that the host's cost per streamed token stays within what a shared
2-core machine drives; the GPU's cost is in the prompts). Requests pick a tenant uniformly and
arrive as a Poisson process. Each load phase has a tenant set of its own, so every phase starts
cold whatever the earlier phases cached.

Capacity is the roofline's, not measured: the request rate at which every worker's GPU is busy
all the time when each request computes its whole prompt (the prefill steps are compute-bound,
and the short answers' decode tokens ride in them), i.e. the fleet without any prefix reuse.
Prefix reuse is what routing can add on top of it.

The oracle keeps every tenant on one worker that never evicts its prompt: every request after
a tenant's first hits the whole system prompt.
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from _routing_client import poisson_arrivals

BLOCK = 16
VOCAB = (5, 31_999)  # the simulated checkpoint's demo tokenizer, special ids excluded


@dataclass(frozen=True, slots=True)
class ChatShape:
    tenants: int
    system_tokens: int  # a multiple of BLOCK: the prefix ends on a block boundary
    turn_tokens: int
    answer_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.system_tokens + self.turn_tokens


class ChatWorkload:
    """One phase's tenants and requests (seeded). Tenant ids are global (``first_tenant`` on), so
    the phases' cache salts differ."""

    def __init__(self, shape: ChatShape, seed: int, first_tenant: int = 0) -> None:
        if shape.system_tokens % BLOCK:
            raise ValueError(f"system_tokens must be a multiple of {BLOCK}")
        self.shape = shape
        self.rng = random.Random(seed)
        self.first_tenant = first_tenant
        self.prefixes = [[self.rng.randint(*VOCAB) for _ in range(shape.system_tokens)]
                         for _ in range(shape.tenants)]

    def request(self) -> tuple[int, list[int]]:
        i = self.rng.randrange(self.shape.tenants)
        turn = [self.rng.randint(*VOCAB) for _ in range(self.shape.turn_tokens)]
        return self.first_tenant + i, self.prefixes[i] + turn

    def arrivals(self, rate: float, duration_s: float) -> list[float]:
        return poisson_arrivals(self.rng, rate, duration_s)


def oracle_hit_rate(tenants: list[int], shape: ChatShape) -> float:
    """Prompt tokens an oracle serves from cache over all prompt tokens, for requests of these
    tenants in this order: all of a tenant's system prompt after its first request."""
    if not tenants:
        return 0.0
    seen: set[int] = set()
    hits = 0
    for t in tenants:
        hits += shape.system_tokens if t in seen else 0
        seen.add(t)
    return hits / (len(tenants) * shape.prompt_tokens)


def prefill_seconds(roofline, prompt_tokens: int, chunk: int, efficiency: float) -> float:
    """A prompt's prefill on one simulated GPU, in chunks of ``chunk`` tokens as the engine
    schedules it, each step at the roofline over the efficiency."""
    from pagefleet.worker.simulated.roofline import step_work

    total, start = 0.0, 0
    while start < prompt_tokens:
        end = min(prompt_tokens, start + chunk)
        total += roofline.cost(step_work([(start, end)])).seconds
        start = end
    return total / efficiency


def simulated_roofline(checkpoint: str, gpu: str):
    """The simulated engine's own roofline for this model and GPU (``worker/simulated/sizing.py``)."""
    from pagefleet.worker.engine_args import EngineArgs
    from pagefleet.worker.model_executor.model_config import load_model_config
    from pagefleet.worker.simulated.sizing import simulated_replica, size_gpu, step_roofline

    replica = simulated_replica(load_model_config(checkpoint), EngineArgs(model=checkpoint, simulate=gpu))
    sizing = size_gpu(replica)
    return step_roofline(replica, sizing), sizing.kv_bytes_per_token


def fleet_capacity(roofline, shape: ChatShape, workers: int, chunk: int, efficiency: float) -> float:
    """Requests/s at which every GPU of the fleet is busy computing whole prompts."""
    return workers / prefill_seconds(roofline, shape.prompt_tokens, chunk, efficiency)


def pressure_kv_bytes(shape: ChatShape, prefixes: int, running: int, kv_bytes_per_token: int) -> int:
    """A pool of ``prefixes`` system prompts beside ``running`` requests' own blocks (turn and
    answer, their prompt's prefix shared)."""
    own = -(-(shape.turn_tokens + shape.answer_tokens) // BLOCK) + 1
    return (prefixes * shape.system_tokens // BLOCK + running * own) * BLOCK * kv_bytes_per_token


def served_model(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def phase_line(policy: str, variant: str, load: float, rate: float, phase, shape: ChatShape, routing) -> dict:
    from _routing_client import ms, pct, spread_ms

    def delta(key: str) -> int:
        return phase.counters_after[key] - phase.counters_before[key]

    ok = [r for r in phase.results if r.kind == "ok"]
    served = [r.tenant for r in phase.results if r.kind in ("ok", "timeout")]  # reached a worker
    refused = [r.latency_s for r in phase.results if r.kind == "429"]
    hit_rate = delta("hits") / max(1, delta("queries"))
    oracle = oracle_hit_rate(served, shape)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    line = {
        "policy": policy, "variant": variant, "load": load, "rate_per_s": round(rate, 2),
        "requests": len(phase.results), "ok": len(ok),
        "achieved_rate_per_s": round(len(phase.results) / phase.wall_s, 2),
        "ttft_p50_ms": ms(pct(ttft, 0.5)), "ttft_p99_ms": ms(pct(ttft, 0.99)),
        "itl_p50_ms": ms(pct([g for r in ok for g in r.itl_s], 0.5)),
        "prefix_hit_rate": round(hit_rate, 3), "oracle_hit_rate": round(oracle, 3),
        "hit_share_of_oracle": round(hit_rate / oracle, 3) if oracle else None,
        "preemptions": delta("preemptions"),
        "429s": len(refused), "429_ms": spread_ms(refused),
        "timeouts": sum(r.kind == "timeout" for r in phase.results),
        "errors": sum(r.kind == "error" for r in phase.results),
        "output_tok_per_s": round(sum(r.output_tokens for r in ok) / phase.wall_s, 1),
        "choose_ms": None, "blocks_per_worker": phase.counters_after["blocks_per_worker"],
    }
    if routing is not None:  # kv: the ingress's own decisions, this phase's only
        choose = routing["choose_s"]
        line["choose_ms"] = {"p50": ms(pct(choose, 0.5)), "p99": ms(pct(choose, 0.99)), "samples": len(choose)}
        line["decisions"] = {**routing["reasons"], "fallbacks": routing["fallbacks"]}
    return line


def main(args) -> None:
    """Every policy on a fresh app of ``args.workers`` simulated workers, the loads in turn, then
    the memory-pressure variant; one JSON line per (variant, policy, load), then a summary."""
    import ray
    from ray import serve

    from pagefleet.cluster.serve_env import free_ports
    from pagefleet.router.global_scheduler.actor import stop_scheduler
    from pagefleet.worker.simulated.checkpoint import simulated_checkpoint

    from _machine import machine_with_load as machine
    from _routing_client import run_phase

    shape = ChatShape(args.tenants, args.system_tokens, args.turn_tokens, args.answer_tokens)
    ckpt = simulated_checkpoint(args.model) or args.model
    roofline, kv_per_token = simulated_roofline(ckpt, args.simulate)
    capacity = fleet_capacity(roofline, shape, args.workers, args.max_num_batched_tokens, args.simulate_efficiency)
    prefixes = args.pressure_prefixes or max(1, args.tenants // 2)
    pressure_bytes = pressure_kv_bytes(shape, prefixes, args.max_num_seqs, kv_per_token)
    info = {"calibration": "roofline", "capacity_requests_per_s": round(capacity, 2),
            "prefill_s": round(prefill_seconds(roofline, shape.prompt_tokens, args.max_num_batched_tokens,
                                               args.simulate_efficiency), 4),
            "hit_step_s": round(roofline.cost(step_work_of_turn(shape)).seconds / args.simulate_efficiency, 4),
            "pressure_kv_blocks": pressure_bytes // (BLOCK * kv_per_token), "pressure_prefixes": prefixes}
    print(json.dumps(info), flush=True)
    variants = [("full_pool", None, args.loads, args.policies)] if args.loads else []
    if args.pressure_load:
        variants.append(("memory_pressure", pressure_bytes, [args.pressure_load],
                         [p for p in args.policies if p in args.pressure_policies]))
    fast_path = start_ray(max(16, 2 * args.workers))
    port = free_ports(1)[0]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    lines, phase_no = [], 0
    scrape = ExitStack()
    prom = start_scrape(scrape) if args.prometheus else None
    dashboards: list[dict] = []
    try:
        for variant, kv_bytes, loads, policies in variants:
            for policy in policies:
                stop_scheduler()
                app = f"sim-{variant}-{policy}"
                started = time.perf_counter()
                serve.run(build_sim_app(ckpt, policy, kv_bytes, args), name=app, route_prefix=f"/{app}")
                deploy_s = time.perf_counter() - started
                base = f"http://127.0.0.1:{port}/{app}"
                model = served_model(base)
                for load in loads:
                    phase_no += 1  # each phase its own tenants: it starts cold, as the oracle does
                    work = ChatWorkload(shape, args.seed + phase_no, first_tenant=phase_no * args.tenants)
                    before = routing_counters(app, policy)
                    phase = run_phase(app, base, model, work, load * capacity, args.phase_s, args.timeout_s,
                                      shape.answer_tokens)
                    line = phase_line(policy, variant, load, load * capacity, phase, shape,
                                      kv_phase(before, routing_counters(app, policy)))
                    line.update(deploy_s=round(deploy_s, 1), loadavg_1m=round(os.getloadavg()[0], 2))
                    print(json.dumps(line), flush=True)
                    lines.append(line)
                if prom is not None and policy == "kv" and not dashboards:
                    dashboards.append(dashboard_line(prom, variant, policy, args.workers))
                    print(json.dumps(dashboards[-1]), flush=True)
                serve.delete(app)
        stop_scheduler()
    finally:
        summary = {"summary": "routing_simulated", "simulate": args.simulate, "model": args.model,
                   "simulate_efficiency": args.simulate_efficiency, "workers": args.workers,
                   "workload": {"tenants": shape.tenants, "system_tokens": shape.system_tokens,
                                "turn_tokens": shape.turn_tokens, "answer_tokens": shape.answer_tokens,
                                "phase_s": args.phase_s, "seed": args.seed},
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "admission": {"queue": args.admission_queue, "max_wait_s": args.admission_wait_s},
                   **info, "ratios": ratios(lines),
                   "http_front": "haproxy" if fast_path else "python_proxy", "machine": machine()}
        print(json.dumps(summary), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                for line in [*lines, *dashboards, summary]:
                    f.write(json.dumps(line) + "\n")
        scrape.close()
        serve.shutdown()
        ray.shutdown()


def start_scrape(stack: ExitStack) -> str:
    """A real Prometheus over the local Ray cluster (``_prometheus``), until ``stack`` closes; its URL."""
    import shutil
    import tempfile

    from pagefleet.cluster.launch import metrics_targets
    from pagefleet.cluster.serve_env import free_ports

    from _prometheus import running_prometheus

    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("--prometheus: no `prometheus` binary on PATH")
    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pf-prometheus-")))
    return stack.enter_context(running_prometheus(binary, work, free_ports(1)[0], targets=metrics_targets()))


def dashboard_line(prom: str, variant: str, policy: str, workers: int) -> dict:
    """The dashboard's queries against the fleet's scrape: how many, and the panels without data;
    the scrape targets up, and the worker replicas that made tokens over the last minute."""
    from _prometheus import RATE_WINDOW, dashboard_queries, queries_without_data, query

    missing = queries_without_data(prom)
    making = query(prom, f"count(sum by (replica) (rate(ray_pagefleet_generation_tokens_total[{RATE_WINDOW}])) > 0)")
    return {"summary": "dashboard", "variant": variant, "policy": policy, "workers": workers,
            "scrape_targets_up": len(query(prom, 'up{job="ray"} == 1')),
            "replicas_making_tokens": int(float(making[0]["value"][1])) if making else 0,
            "queries": len(dashboard_queries()), "without_data": [title for title, _ in missing]}


def start_ray(num_cpus: int) -> bool:
    """``start_local_ray``, again if the node's agents were too slow to come up (a busy machine)."""
    import ray

    from pagefleet.cluster.launch import start_local_ray

    for _ in range(2):
        try:
            return start_local_ray(num_cpus=num_cpus, log_to_driver=False)
        except Exception:  # noqa: BLE001  (Ray raises a bare Exception when the node times out starting)
            ray.shutdown()
    return start_local_ray(num_cpus=num_cpus, log_to_driver=False)


def step_work_of_turn(shape: ChatShape):
    """A hit: only the turn is computed, after the cached system prompt."""
    from pagefleet.worker.simulated.roofline import step_work

    return step_work([(shape.system_tokens, shape.prompt_tokens)])


def build_sim_app(ckpt: str, policy: str, kv_bytes: int | None, args):
    from pagefleet.cluster.app import build_app

    return build_app({
        "model": ckpt, "simulate": args.simulate, "simulate_efficiency": args.simulate_efficiency,
        "workers": args.workers, "worker_num_cpus": 0.25, "ingress_num_cpus": 0.5,
        "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "routing": policy,
        "admission_queue_size": args.admission_queue, "admission_max_wait_s": args.admission_wait_s,
        **({"kv_cache_bytes": kv_bytes} if kv_bytes else {})})


def routing_counters(app: str, policy: str):
    """kv's decision counters so far, from the ingress; None for the other policies (they decide
    inside Serve's router)."""
    if policy != "kv":
        return None
    from ray import serve

    return serve.get_deployment_handle("OpenAIIngress", app).counters.remote().result().routing


def kv_phase(before, after) -> dict | None:
    """One phase's kv decisions: their times (seconds), reasons and fallbacks."""
    if after is None:
        return None
    return {"choose_s": list(after.choose_s)[len(before.choose_s):],
            "reasons": dict(after.decisions - before.decisions), "fallbacks": after.fallbacks - before.fallbacks}


def ratios(lines: list[dict]) -> dict:
    """The issue's comparisons, per load of the full pool; kv's share of the oracle under pressure."""
    out: dict = {}
    by = {(x["variant"], x["policy"], x["load"]): x for x in lines}
    for (variant, policy, load), kv in by.items():
        if policy != "kv":
            continue
        entry = {"kv_hit_share_of_oracle": kv["hit_share_of_oracle"]}
        for other in ("ray_prefix", "round_robin", "least_loaded"):
            o = by.get((variant, other, load))
            if o and kv["ttft_p50_ms"] and o["ttft_p50_ms"]:
                entry[f"ttft_p50_{other}_over_kv"] = round(o["ttft_p50_ms"] / kv["ttft_p50_ms"], 2)
        rr = by.get((variant, "round_robin", load))
        if rr:
            entry["preemptions_kv_over_round_robin"] = round(kv["preemptions"] / max(rr["preemptions"], 1), 3)
        entry["kv_429_p99_ms"] = kv["429_ms"]["p99"]
        out[f"{variant}@{load}"] = entry
    return out
