"""One request can no longer take a replica down (security round 3, A1), through the real server.

A grammar that allows no token at all, or none after its first, with a random draw and logprobs,
once made the sampler return id ``vocab_size``: the logprob gather (or, with async scheduling,
the embedding of the step launched ahead) raised and the engine loop died for every stream on
the replica. Here a poison request goes in every 2 s while six clients stream, with and without
async scheduling: every stream completes in full and each poison gets a 400 or a clean finish.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from cluster_helpers import StreamedCompletion, wait_until_running
from conftest import free_port

APP = "pagefleet-poison"
SERVED = "poison-llama"  # its own name: other modules' metrics select theirs by model name
CLIENTS = 6
STREAM_TOKENS = 48
POISONS = 3  # pairs, one every POISON_EVERY_S, while the clients stream
POISON_EVERY_S = 2.0


@pytest.fixture(scope="module", params=["sync", "async_scheduling"])
def server(request, ray_cluster, tiny_checkpoint):
    from ray import serve

    from pagefleet.cluster.app import build_app
    from pagefleet.router.global_scheduler.actor import stop_scheduler

    serve.shutdown()
    stop_scheduler()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    ckpt = tiny_checkpoint("llama")
    mode = {} if request.param == "sync" else {"async_output_proc": True, "async_scheduling": True}
    app = build_app({"model": str(ckpt), "workers": 1, "kv_cache_bytes": "16MiB", "max_model_len": 512,
                     "max_num_seqs": 16, "worker_num_cpus": 0.5, "ingress_num_cpus": 0.25,
                     "served_model_name": SERVED, **mode})
    serve.run(app, name=APP, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_until_running(APP)
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    yield base, SERVED
    serve.shutdown()
    stop_scheduler()


def _poison(base: str, model: str, regex: str) -> tuple:
    body = {"model": model, "prompt": "Say something.", "max_tokens": 8, "temperature": 1, "logprobs": 1,
            "structured_outputs": {"regex": regex}}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    if r.status_code != 200:
        return r.status_code, r.json()["error"]["param"]
    choice = r.json()["choices"][0]
    return 200, choice["text"], choice["finish_reason"], choice["logprobs"]["tokens"]


def test_poison_requests_beside_streams_end_alone(server):
    base, model = server
    poisoning = threading.Event()  # set while the poisons go in: the clients stream until it clears
    poisoning.set()
    streams: list[StreamedCompletion] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        while poisoning.is_set():
            s = StreamedCompletion(f"{base}/v1/completions",
                                   {"model": model, "prompt": f"client {i} keeps talking", "stream": True,
                                    "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
                                    "stream_options": {"include_usage": True}})
            with lock:
                streams.append(s)
            s.run()

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in clients:
        t.start()
    poisons = []
    for _ in range(POISONS):
        poisons.append((_poison(base, model, "[^\\s\\S]"), _poison(base, model, "a[^\\s\\S]")))
        time.sleep(POISON_EVERY_S)
    poisoning.clear()
    for t in clients:
        t.join(300)
    assert not any(t.is_alive() for t in clients)

    assert len(streams) >= CLIENTS
    for s in streams:
        assert s.outcome() == (200, True, [], STREAM_TOKENS, None)
    for empty, after_a in poisons:
        # Refused at compile time, or ended by the engine before its first token.
        assert empty in ((400, "structured_outputs"), (200, "", "stop", []))
        assert after_a == (200, "a", "stop", ["a"])
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
