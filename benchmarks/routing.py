"""Routing policies side by side: one cluster of 4 worker replicas per policy, the same workload.

The workload (seeded): 16 tenants, each with its own 512-token system prompt
(and its own cache_salt), asking 32-token questions with 64 tokens of answer,
Poisson arrivals over the tenants. The KV pool of each worker (192 blocks of
16 tokens) holds about a third of the tenants' prefixes (32 blocks each)
beside its running requests, so where a request lands decides whether its
512-token prefix is computed again, and eight requests of eight different
tenants do not fit on one worker at once. The model is the tiny demo checkpoint
(128 x 2 layers: a prefill costs little beside the serving path, so TTFT barely
shows what a prefix hit saves); ``--size small`` runs the 512 x 8 Llama (vocab
32000) instead, with the same pools in blocks.

The local Ray cluster is started the way `pagefleet serve` starts its own
(``launch.start_local_ray``: HAProxy in front when its binary is installed,
Ray's quieter control loops, token authentication, and Ray's control processes
moved to idle CPU priority once each app is up), so the figures are those of the server users run.
Summary lines without ``http_front`` came from a plain ``ray.init`` (Serve's
Python proxy, Ray's defaults).

Per policy, on a fresh app (fresh caches) on one local Ray cluster:
  normal    Poisson arrivals at ``--load`` x capacity for ``--normal-s``
  overload  Poisson arrivals at 3 x capacity for ``--overload-s``
Capacity (requests/s) is measured once, first, with round_robin and a
closed loop of 64 clients. kv runs with admission control (a queue of
``--admission-queue`` per ingress, ``--admission-wait-s``); the others have none.
kv decides in the ingress, with its copy of the global scheduler's view (kept
current from the actor's feed); choose_ms reports those local decisions, and
``mirror`` how the copy followed the feed (updates, entries, resyncs, failed
polls).

One JSON line per policy: prefix hit rate from the workers' own counters
(normal phase) and the hit rate an oracle would get on the same requests (every
tenant's prefix cached after its first request), TTFT p50/p99 and output
tokens/s (normal phase), preemptions, 429s and their latency (all of them, and
those refused on arrival: the rest waited out admission's maximum wait first),
timeouts (each phase), time to choose a replica p50/p99 and fallbacks (kv: the ingress's
decisions with its copy of the view, and the requests routed while the copy was
stale or empty; the other policies choose inside Serve's router), then a summary line with the ratios the issue asks for and the
machine (load average included: on a shared machine it says how much of the
CPU the run had).

The client is this file's own (aiohttp, the HTTP client of `pagefleet bench` and
`vllm bench serve`; streaming completions with token-id prompts), written before
`pagefleet bench` landed; it also reads the workers' and the ingress's own
counters between phases, which `pagefleet bench` does not. It used httpx's async
client until 2026-12-01, whose own cost shows in bursts (96 requests at once to a
bare uvicorn app: p99 129-2,822 ms, raw asyncio sockets 6-10 ms); in this
workload's spread-out arrivals it made little difference (kv's 429s at p99 158 ms
with httpx and 167 ms with aiohttp in adjacent runs).

``--simulate GPU`` runs the policies over a fleet of simulated GPU workers instead, with a
multi-tenant chat workload at several fractions of the fleet's roofline capacity and a
memory-pressure variant (``_routing_sim.py`` says how).

    python benchmarks/routing.py                      # all policies (about 15 minutes on 2 cores)
    python benchmarks/routing.py --policies kv round_robin --normal-s 20 --overload-s 10
    python benchmarks/routing.py --simulate h200 --workers 16      # about 40 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, here and in the replicas
os.environ.setdefault("RAY_AUTH_MODE", "token")  # as `pagefleet serve` runs its local Ray (read at `import ray`)

import aiohttp

from _machine import machine_with_load as machine
from _routing_client import (
    NO_TIMEOUT,
    Phase,
    Result,
    ms,
    one_request,
    pct,
    poisson_arrivals,
    run_phase as run_client_phase,
    spread_ms,
    wait_idle,
)

POLICIES = ("round_robin", "kv", "least_loaded", "pow2", "prefix", "ray_prefix")
SIMULATED_POLICIES = ("kv", "ray_prefix", "round_robin", "least_loaded")
TENANTS = 16
SYSTEM_TOKENS = 512
QUESTION_TOKENS = 32
ANSWER_TOKENS = 64
BLOCK = 16
WORKERS = 4
KV_BLOCKS = 192  # per worker: about a third of the tenants' prefixes
VOCAB = (5, 999)  # the demo tokenizer's ids, special ones excluded



class Workload:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randint(*VOCAB) for _ in range(SYSTEM_TOKENS)] for _ in range(TENANTS)]

    def request(self) -> tuple[int, list[int]]:
        tenant = self.rng.randrange(TENANTS)
        return tenant, self.prefixes[tenant] + [self.rng.randint(*VOCAB) for _ in range(QUESTION_TOKENS)]

    def arrivals(self, rate: float, duration_s: float) -> list[float]:
        return poisson_arrivals(self.rng, rate, duration_s)



async def closed_loop(base: str, model: str, work: Workload, clients: int, duration_s: float) -> float:
    """Requests completed per second with ``clients`` always busy (the capacity)."""
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients), timeout=NO_TIMEOUT) as http:
        start = time.perf_counter()

        async def client() -> None:
            nonlocal done
            while time.perf_counter() - start < duration_s:
                tenant, prompt = work.request()
                r = await one_request(http, base, model, tenant, prompt, 120, ANSWER_TOKENS)
                done += r.kind == "ok"

        await asyncio.gather(*(client() for _ in range(clients)))
        return done / (time.perf_counter() - start)



def oracle_hit_rate(results: list[Result], seen: set[int]) -> float:
    """An oracle sends every tenant to one worker that keeps its prefix: everything after a
    tenant's first request hits its whole system prompt (the engine never counts more)."""
    hits = queries = 0
    for r in results:
        queries += SYSTEM_TOKENS + QUESTION_TOKENS
        if r.tenant in seen:
            hits += SYSTEM_TOKENS
        seen.add(r.tenant)
    return hits / queries if queries else 0.0



def run_phase(app: str, base: str, model: str, work: Workload, rate: float, duration_s: float,
              timeout_s: float) -> Phase:
    return run_client_phase(app, base, model, work, rate, duration_s, timeout_s, ANSWER_TOKENS)


def block_bytes(size: str) -> int:
    """One KV block of the demo checkpoint of that size (fp32 keys and values, every layer)."""
    from pagefleet.cluster.demo.model import DEMO_SIZES

    s = DEMO_SIZES[size]
    return 2 * s.num_hidden_layers * s.num_key_value_heads * (s.hidden_size // s.num_attention_heads) * BLOCK * 4


def deploy(policy: str, ckpt: Path, args: argparse.Namespace) -> str:
    from ray import serve

    from pagefleet.cluster.app import build_app
    from pagefleet.cluster.cpu_priority import idle_control_plane

    app = f"bench-{policy}"
    serve.run(build_app({
        "model": str(ckpt), "workers": WORKERS, "worker_num_cpus": 0.5, "ingress_num_cpus": 0.5,
        "kv_cache_bytes": KV_BLOCKS * block_bytes(args.size), "max_model_len": 1024, "max_num_seqs": 8, "routing": policy,
        "admission_queue_size": args.admission_queue, "admission_max_wait_s": args.admission_wait_s,
        "routing_max_staleness_s": args.routing_max_staleness_s}),
        name=app, route_prefix=f"/{policy}")
    idle_control_plane()  # as `pagefleet serve` does (this app's global scheduler is a new process)
    return app


def summarize(policy: str, normal: Phase, overload: Phase, oracle: float, routing, admission, mirror,
              view=None) -> dict:
    def delta(phase: Phase, key: str) -> int:
        return phase.counters_after[key] - phase.counters_before[key]

    ok = [r for r in normal.results if r.kind == "ok"]
    over_429 = [r.latency_s for r in overload.results if r.kind == "429"]
    on_arrival = [r.latency_s for r in overload.results if r.kind == "429" and not r.waited]
    line = {
        "policy": policy,
        "requests": {"normal": len(normal.results), "overload": len(overload.results)},
        "prefix_hit_rate": round(delta(normal, "hits") / max(1, delta(normal, "queries")), 3),
        "oracle_hit_rate": round(oracle, 3),
        "ttft_p50_ms": ms(pct([r.ttft_s for r in ok if r.ttft_s is not None], 0.5)),
        "ttft_p99_ms": ms(pct([r.ttft_s for r in ok if r.ttft_s is not None], 0.99)),
        "output_tok_per_s": round(sum(r.output_tokens for r in ok) / normal.wall_s, 1),
        "normal_not_ok": {k: sum(r.kind == k for r in normal.results) for k in ("429", "timeout", "error")},
        "preemptions": {"normal": delta(normal, "preemptions"), "overload": delta(overload, "preemptions")},
        "overload_ok": sum(r.kind == "ok" for r in overload.results),
        "overload_429s": len(over_429),
        "overload_429_ms": spread_ms(over_429),
        # Not after waiting out admission's maximum wait (queue full, too long a wait ahead, or a
        # worker's own full queue): what "answered at once" means.
        "overload_429_on_arrival_ms": {"n": len(on_arrival), **spread_ms(on_arrival)},
        "overload_timeouts": sum(r.kind == "timeout" for r in overload.results),
        "overload_errors": sum(r.kind == "error" for r in overload.results),
        "choose_ms": None, "fallbacks": None,
    }
    if routing is not None:
        choose = list(routing.choose_s)
        line["choose_ms"] = {"p50": ms(pct(choose, 0.5)), "p99": ms(pct(choose, 0.99)), "samples": len(choose),
                             "over_10ms": sum(c > 0.010 for c in choose)}
        line["fallbacks"] = routing.fallbacks
        line["decisions"] = dict(routing.decisions)
        line["predicted_vs_realised_hit_blocks"] = [routing.predicted_hit_blocks, routing.realised_hit_blocks]
    if admission is not None:
        line["admission"] = {"admitted_at_once": admission.admitted_at_once,
                             "admitted_after_waiting": admission.admitted_after_waiting,
                             "refused_queue_full": admission.rejected_queue_full,
                             "refused_expected_wait": admission.rejected_expected_wait,
                             "refused_after_waiting": admission.rejected_waited_too_long}
    if mirror is not None:
        line["mirror"] = {"updates": mirror.updates, "entries": mirror.entries, "resyncs": mirror.resyncs,
                          "failed_polls": mirror.failed_polls}
    if view is not None:  # the ingress's copy: how its predictions ended
        line["predictions"] = {"confirmed": view.predictions_confirmed, "expired": view.predictions_expired,
                               "decisions_without_room": view.decisions_without_room}
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=None, choices=POLICIES,
                    help=f"default: {' '.join(POLICIES[:-1])}; with --simulate: {' '.join(SIMULATED_POLICIES)}")
    ap.add_argument("--load", type=float, default=0.6, help="normal phase arrival rate, as a fraction of capacity")
    ap.add_argument("--normal-s", type=float, default=60.0)
    ap.add_argument("--overload-s", type=float, default=20.0)
    ap.add_argument("--capacity", type=float, default=None, help="requests/s (default: measure it first)")
    ap.add_argument("--admission-queue", type=int, default=4)
    ap.add_argument("--admission-wait-s", type=float, default=2.0)
    ap.add_argument("--routing-max-staleness-s", type=float, default=1.0)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="a client gives up after this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small"),
                    help="demo checkpoint: tiny (128 x 2 layers) or small (512 x 8, vocab 32000: prefill costs more)")
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    sim = ap.add_argument_group("--simulate: a fleet of simulated GPU workers (benchmarks/_routing_sim.py)")
    sim.add_argument("--simulate", default=None, metavar="GPU", help="e.g. h200 (docs/simulator.md)")
    sim.add_argument("--simulate-efficiency", type=float, default=0.1)
    sim.add_argument("--model", default="llama-3-8b")
    sim.add_argument("--workers", type=int, default=16)
    sim.add_argument("--tenants", type=int, default=32)
    sim.add_argument("--system-tokens", type=int, default=6144)
    sim.add_argument("--turn-tokens", type=int, default=128)
    sim.add_argument("--answer-tokens", type=int, default=16)
    sim.add_argument("--loads", type=float, nargs="*", default=[0.5, 1.0, 2.0],
                     help="fractions of capacity (none: the memory-pressure variant alone)")
    sim.add_argument("--phase-s", type=float, default=20.0, help="arrivals per load, seconds")
    sim.add_argument("--pressure-load", type=float, default=1.0,
                     help="the memory-pressure variant's load (0: no such variant)")
    sim.add_argument("--pressure-policies", nargs="+", default=["kv", "ray_prefix", "round_robin"], choices=POLICIES)
    sim.add_argument("--pressure-prefixes", type=int, default=None,
                     help="system prompts each pool holds beside its running requests (default: half the tenants)")
    sim.add_argument("--prometheus", action="store_true",
                     help="scrape the fleet with a real Prometheus (the `prometheus` binary on PATH) and "
                          "evaluate every query of the Grafana dashboard after kv's loads")
    sim.add_argument("--max-num-seqs", type=int, default=32)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sim.add_argument("--max-model-len", type=int, default=8192)
    args = ap.parse_args()
    if args.simulate:
        from _routing_sim import main as simulated_main

        args.policies = args.policies or list(SIMULATED_POLICIES)
        return simulated_main(args)
    args.policies = args.policies or list(POLICIES[:-1])

    import ray
    from ray import serve

    from pagefleet.cluster.demo.model import write_demo_checkpoint
    from pagefleet.cluster.launch import start_local_ray
    from pagefleet.cluster.serve_env import free_ports
    from pagefleet.router.global_scheduler.actor import stop_scheduler

    ckpt = write_demo_checkpoint(Path(tempfile.mkdtemp(prefix="pf-routing-")) / f"demo-{args.size}-llama",
                                 size=args.size)
    # The cluster `pagefleet serve` runs: HAProxy in front, Ray's quieter control loops, and its
    # control processes at idle CPU priority once each app is up.
    fast_path = start_local_ray(num_cpus=16, log_to_driver=False)
    port = free_ports(1)[0]  # outside the range Ray's own processes get theirs from
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    capacity = args.capacity
    lines = []
    for policy in args.policies:
        stop_scheduler()  # each kv run starts with an empty view
        app = deploy(policy, ckpt, args)
        base = f"http://127.0.0.1:{port}/{policy}"
        model = ckpt.name
        if capacity is None:
            capacity = asyncio.run(closed_loop(base, model, Workload(args.seed + 99), clients=64, duration_s=20))
            wait_idle(app)
            print(json.dumps({"calibration": "capacity", "policy": policy, "requests_per_s": round(capacity, 2)}),
                  flush=True)
            serve.delete(app)  # the measured run starts on fresh caches too
            app = deploy(policy, ckpt, args)
        work = Workload(args.seed)
        normal = run_phase(app, base, model, work, args.load * capacity, args.normal_s, args.timeout_s)
        overload = run_phase(app, base, model, work, 3 * capacity, args.overload_s, args.timeout_s)
        oracle = oracle_hit_rate(normal.results, set())
        routing = admission = mirror = view = None
        if policy == "kv":
            ingress = serve.get_deployment_handle("OpenAIIngress", app)
            counters = ingress.counters.remote().result()
            routing, admission, mirror, view = counters.routing, counters.admission, counters.mirror, counters.view
        line = summarize(policy, normal, overload, oracle, routing, admission, mirror, view)
        line.update(capacity_requests_per_s=round(capacity, 2), normal_rate=round(args.load * capacity, 2),
                    overload_rate=round(3 * capacity, 2), loadavg_1m=round(os.getloadavg()[0], 2))
        print(json.dumps(line), flush=True)
        lines.append(line)
        serve.delete(app)
    stop_scheduler()
    by = {line["policy"]: line for line in lines}
    summary = {"summary": "routing", "workload": {"tenants": TENANTS, "system_tokens": SYSTEM_TOKENS,
                                                  "question_tokens": QUESTION_TOKENS, "answer_tokens": ANSWER_TOKENS,
                                                  "workers": WORKERS, "kv_blocks_per_worker": KV_BLOCKS,
                                                  "normal_s": args.normal_s, "overload_s": args.overload_s,
                                                  "load": args.load, "seed": args.seed, "model": args.size},
               "admission": {"queue": args.admission_queue, "max_wait_s": args.admission_wait_s},
               "routing_max_staleness_s": args.routing_max_staleness_s,
               "http_front": "haproxy" if fast_path else "python_proxy",
               "machine": machine()}
    kv, rr = by.get("kv"), by.get("round_robin")
    if kv and rr:
        summary["kv_hit_rate_vs_oracle"] = round(kv["prefix_hit_rate"] / kv["oracle_hit_rate"], 3)
        summary["kv_hit_rate_vs_round_robin"] = round(kv["prefix_hit_rate"] / max(rr["prefix_hit_rate"], 1e-9), 2)
        summary["ttft_p50_round_robin_over_kv"] = round(rr["ttft_p50_ms"] / kv["ttft_p50_ms"], 2)
        summary["overload_preemptions_kv_over_round_robin"] = round(
            kv["preemptions"]["overload"] / max(rr["preemptions"]["overload"], 1), 3)
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for line in lines + [summary]:
                f.write(json.dumps(line) + "\n")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
