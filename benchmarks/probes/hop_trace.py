"""Where a request's first token spends its time on the Ray path, hop by hop.

Starts `pagefleet serve` (local Ray, one worker replica) with ``--otlp-traces-endpoint`` pointing
at a small OTLP/HTTP receiver in this process, sends streaming completions one at a time (random
prompts of --input-len tokens, --output-len tokens, EOS ignored), each with a W3C ``traceparent``
of its own so that the spans the server exports (``worker/tracing.py``) name the request, and
prints one JSON line: for each hop, the median time since the client sent the request and since
the hop before, in milliseconds, over the requests.

    python benchmarks/probes/hop_trace.py                      # 20 requests, 256 in, 16 out
    python benchmarks/probes/hop_trace.py --model DIR --requests 50
    python benchmarks/probes/hop_trace.py --simulate h200 --input-len 32 --output-len 128   # at GPU rates

Hops, in order: client_sent; ingress_http (the ingress's handler starts: the HTTP front,
HAProxy or Serve's Python proxy, and its hand-off to the ingress replica lie before it);
ingress_prepared (parsed, tokenized, hashed); ingress_routed (the global scheduler's copy
decided); ingress_sent (handed to Serve's handle); worker_generate (the worker replica's method
starts); engine_added (the engine thread took the request in); engine_first_token (the step that
made its first token returned); ingress_first_delta (its first delta reached the ingress's
response); client_first_chunk. Then the last token: engine_finished and client_done.

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
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks beside probes/

from _machine import machine  # noqa: E402
from cpu_contention import role_deltas, sample  # noqa: E402
from serving import BIN, Server, checkpoint, free_port  # noqa: E402

HOPS = ("client_sent", "ingress_http", "ingress_prepared", "ingress_routed", "ingress_sent", "worker_generate",
        "engine_added", "engine_first_token", "ingress_first_delta", "client_first_chunk")
LAST = ("engine_finished", "client_done")
# Where each server hop is in the spans: (span name, None for its start or the event's name).
SPAN_HOPS = {"ingress_http": ("pagefleet.request", None), "ingress_prepared": ("pagefleet.request", "prepared"),
             "ingress_routed": ("pagefleet.request", "routed"), "ingress_sent": ("pagefleet.request", "sent"),
             "ingress_first_delta": ("pagefleet.request", "first_delta"),
             "worker_generate": ("pagefleet.worker.generate", None),
             "engine_added": ("pagefleet.worker.generate", "engine_added"),
             "engine_first_token": ("pagefleet.worker.generate", "engine_first_token"),
             "engine_finished": ("pagefleet.worker.generate", "engine_finished")}


class SpanReceiver:
    """An OTLP/HTTP trace receiver (protobuf, as the exporter sends it by default) on loopback:
    keeps, per trace id, each span's start and event times in seconds."""

    def __init__(self) -> None:
        self.traces: dict[str, dict[str, float]] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 — the http.server name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        times = self.traces.setdefault(span.trace_id.hex(), {})
                        times[span.name] = span.start_time_unix_nano / 1e9
                        for event in span.events:
                            times[f"{span.name}:{event.name}"] = event.time_unix_nano / 1e9

    def hops(self, trace_id: str) -> dict[str, float]:
        with self.lock:
            times = self.traces.get(trace_id, {})
            return {hop: times[span if event is None else f"{span}:{event}"]
                    for hop, (span, event) in SPAN_HOPS.items()
                    if (span if event is None else f"{span}:{event}") in times}


def stream_one(client: httpx.Client, base: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streaming request under a trace of its own: its trace id and the client's times."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    times: dict = {"client_sent": time.time()}
    with client.stream("POST", f"{base}/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and "client_first_chunk" not in times:
                times["client_first_chunk"] = time.time()
    times["client_done"] = time.time()
    return {"trace_id": trace_id, **times}


def wait_for_spans(receiver: SpanReceiver, client_times: list[dict], timeout_s: float = 30.0) -> None:
    """The server exports its spans in batches every few seconds: wait until every request's came."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(len(receiver.hops(c["trace_id"])) == len(SPAN_HOPS) for c in client_times):
            return
        time.sleep(0.5)


def summarize(client_times: list[dict], receiver: SpanReceiver) -> dict:
    rows = [{**receiver.hops(c["trace_id"]), **{k: v for k, v in c.items() if k != "trace_id"}}
            for c in client_times]
    rows = [r for r in rows if all(h in r for h in HOPS + LAST)]
    if not rows:
        raise RuntimeError(f"no request has every hop in the spans received ({len(receiver.traces)} traces)")
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
    p.add_argument("--simulate", default=None, metavar="GPU",
                   help="serve the simulated GPU engine (docs/simulator.md); --model then defaults to llama-3-8b")
    args = p.parse_args()
    ckpt = checkpoint(args.model, args.simulate)
    model_args = ["--model", ckpt] if args.simulate is None else ["--model", args.model or "llama-3-8b",
                                                                  "--simulate", args.simulate]
    workdir = Path(tempfile.mkdtemp(prefix="pf-hop-trace-"))
    receiver = SpanReceiver()
    port = free_port()
    server = Server([str(BIN / "pagefleet"), "serve", *model_args, "--port", str(port),
                     "--metrics-export-port", str(free_port()), "--log-stats-interval", "0",
                     "--otlp-traces-endpoint", receiver.endpoint],
                    f"http://127.0.0.1:{port}", workdir / "pagefleet-serve.log")
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
            wait_for_spans(receiver, times)
    finally:
        server.stop()
    print(json.dumps({"benchmark": "hop_trace", "simulate": args.simulate, "input_len": args.input_len, "output_len": args.output_len,
                      **summarize(times, receiver), "request_wall_ms": round(1e3 * statistics.median(walls), 1),
                      "cpu_per_request_ms": cpu_medians(busy), "cpu_per_idle_window_ms": cpu_medians(idle),
                      "machine": machine()}))
    print(f"server log: {workdir}", file=sys.stderr)


if __name__ == "__main__":
    main()
