"""Where a request's first token spends its time on the Ray path, hop by hop.

Starts `pagefleet serve` (local Ray, one worker replica) with PAGEFLEET_HOP_TRACE set, so that
the ingress, the worker replica and its engine thread each write the time a request passes
their hops (``worker/replica/hop_trace.py``), sends streaming completions one at a time (random
prompts of --input-len tokens, --output-len tokens, EOS ignored) with the client's own send and
first-chunk times, and prints one JSON line: for each hop, the median time since the client
sent the request and since the hop before, in milliseconds, over the requests.

    python benchmarks/hop_trace.py                      # 20 requests, 256 in, 16 out
    python benchmarks/hop_trace.py --model DIR --requests 50

Hops, in order: client_sent; ingress_http (the ingress's handler starts: the HTTP front,
HAProxy or Serve's Python proxy, and its hand-off to the ingress replica lie before it); ingress_prepared (parsed, tokenized, hashed);
ingress_routed (the global scheduler's copy decided); ingress_sent (handed to Serve's handle);
worker_generate (the worker replica's method starts); engine_added (the engine thread took the
request in); engine_first_token (the step that made its first token returned); worker_channel_put
(on the delta channel); ingress_channel_recv (the ingress read it off the channel);
ingress_first_delta; ingress_first_chunk (about to become an SSE event); client_first_chunk.
Then the last token: engine_finished and client_done.

Beside the hops, per process role (``cpu_contention``: worker, ingress, proxy, scheduler,
controller, GCS, raylet), the median over requests of the CPU ms its threads used and the ms
they waited on a run queue while one request was in flight (``cpu_per_request_ms``), and the
same over windows of the same length with no request (``cpu_per_idle_window_ms``). On a small
machine a served engine's threads computing at the lowest priority lose what the serving
threads take during its steps: the worker's wait and the others' CPU say how much. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _machine import machine
from cpu_contention import role_deltas, sample
from serving import BIN, Server, checkpoint, free_port

HOPS = ("client_sent", "ingress_http", "ingress_prepared", "ingress_routed", "ingress_sent", "worker_generate",
        "engine_added", "engine_first_token", "worker_channel_put", "ingress_channel_recv", "ingress_first_delta",
        "ingress_first_chunk", "client_first_chunk")
LAST = ("engine_finished", "client_done")


def stream_one(client: httpx.Client, base: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    times: dict = {"client_sent": time.time()}
    request_id = None
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if request_id is None:
                times["client_first_chunk"] = time.time()
                request_id = json.loads(line[6:])["id"]
    times["client_done"] = time.time()
    return {"id": f"{request_id}-0", **times}  # the engine's id of the request's first prompt


def summarize(client_times: list[dict], trace: Path) -> dict:
    server: dict[str, dict[str, float]] = {}
    for line in trace.read_text().splitlines():
        request_id, hop, t = line.split()
        server.setdefault(request_id, {})[hop] = float(t)
    rows = [{**server.get(c["id"], {}), **{k: v for k, v in c.items() if k != "id"}} for c in client_times]
    rows = [r for r in rows if all(h in r for h in HOPS + LAST)]
    if not rows:
        raise RuntimeError(f"no request has every hop in {trace}")
    out = {}
    for prev, hop in zip(HOPS, HOPS[1:]):
        out[hop] = {"since_sent_ms": round(statistics.median(1e3 * (r[hop] - r["client_sent"]) for r in rows), 2),
                    "since_previous_ms": round(statistics.median(1e3 * (r[hop] - r[prev]) for r in rows), 2)}
    out["engine_finished -> client_done"] = {
        "median_ms": round(statistics.median(1e3 * (r["client_done"] - r["engine_finished"]) for r in rows), 2)}
    return {"requests": len(rows), "hops": out}


def cpu_medians(windows: list[dict]) -> dict:
    """Per process role, the median over windows of its CPU ms and run-queue wait ms (summed over
    its threads) and its worst thread's wait."""
    roles = sorted({r for w in windows for r in w})
    zero = {"cpu_ms": 0.0, "wait_ms": 0.0, "max_thread_wait_ms": 0.0}
    return {r: {k: round(statistics.median(w.get(r, zero)[k] for w in windows), 1) for k in zero} for r in roles}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the random-weight 512x8 Llama)")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    args = p.parse_args()
    ckpt = checkpoint(args.model)
    workdir = Path(tempfile.mkdtemp(prefix="pf-hop-trace-"))
    trace = workdir / "hops.txt"
    port = free_port()
    server = Server([str(BIN / "pagefleet"), "serve", "--model", ckpt, "--port", str(port),
                     "--metrics-export-port", str(free_port()), "--log-stats-interval", "0"],
                    f"http://127.0.0.1:{port}", workdir / "pagefleet-serve.log",
                    env={**os.environ, "PAGEFLEET_HOP_TRACE": str(trace)})
    rng = random.Random(0)
    try:
        server.wait_ready()
        with httpx.Client(timeout=120) as client:
            model = client.get(f"{server.base}/v1/models").json()["data"][0]["id"]
            for _ in range(3):  # untimed: first requests are slow
                stream_one(client, server.base, model, [rng.randrange(1000, 30000) for _ in range(args.input_len)],
                           args.output_len)
            times, busy, walls = [], [], []
            for _ in range(args.requests):
                prompt = [rng.randrange(1000, 30000) for _ in range(args.input_len)]
                before, t0 = sample(), time.monotonic()
                times.append(stream_one(client, server.base, model, prompt, args.output_len))
                walls.append(time.monotonic() - t0)
                busy.append(role_deltas(before, sample()))
            idle = []  # the same windows with no request: what the processes spend anyway
            for _ in range(args.requests):
                before = sample()
                time.sleep(statistics.median(walls))
                idle.append(role_deltas(before, sample()))
    finally:
        server.stop()
    print(json.dumps({"benchmark": "hop_trace", "input_len": args.input_len, "output_len": args.output_len,
                      **summarize(times, trace), "request_wall_ms": round(1e3 * statistics.median(walls), 1),
                      "cpu_per_request_ms": cpu_medians(busy), "cpu_per_idle_window_ms": cpu_medians(idle),
                      "machine": machine()}))
    print(f"trace and server log: {workdir}", file=sys.stderr)


if __name__ == "__main__":
    main()
