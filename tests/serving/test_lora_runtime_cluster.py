"""Runtime LoRA adapters on a real Serve app (two ingress replicas, two worker replicas): an adapter
loaded over HTTP is listed by every ingress replica and served by every worker replica, though the
load reached one of each; a bad one is a 400 with the engine's reason from across Ray; unloaded, a 404."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from cluster_helpers import wait_until_running, worker_stats
from conftest import free_port
from lora_helpers import ADAPTERS, write_adapter

APP = "pagefleet-lora"
# A name of its own: the metrics exporter keeps this app's series (by model name) after it is
# gone, and later modules that serve the tiny Llama count theirs by its name.
SERVED = "lora-cluster-base"
CONCURRENT = 8


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_checkpoint, tmp_path_factory):
    from ray import serve

    from pagefleet.cluster.app import build_app
    from pagefleet.router.global_scheduler.actor import stop_scheduler
    from pagefleet.router.lora_registry import stop_lora_registry

    ckpt = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    paths = {name: str(write_adapter(ckpt, root / name, *ADAPTERS[name])) for name in ("sql", "chat")}
    serve.shutdown()
    stop_scheduler()
    stop_lora_registry(SERVED)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({"model": str(ckpt), "workers": 2, "ingress_replicas": 2, "kv_cache_bytes": "8MiB",
                     "max_model_len": 256, "max_num_seqs": 8, "worker_num_cpus": 0.5, "ingress_num_cpus": 0.25,
                     "enable_lora": True, "max_lora_rank": 4, "allow_runtime_lora_updating": True,
                     "served_model_name": SERVED})
    serve.run(app, name=APP, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_until_running(APP)
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    yield base, SERVED, paths
    serve.shutdown()
    stop_scheduler()
    stop_lora_registry(SERVED)


def test_loaded_once_every_replica_lists_and_serves_it(server):
    base, name, paths = server
    with httpx.Client(base_url=base, timeout=120) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": paths["chat"]})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == f"Loading lora chat failed: {paths['chat']}: rank 8 is over " \
                                               "max_lora_rank 4"
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": paths["sql"]})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
        # The HTTP proxy spreads these over both ingress replicas; each follows the registry.
        for _ in range(3):
            models = [[(m["id"], m["parent"]) for m in http.get("/v1/models").json()["data"]] for _ in range(6)]
            if all(m == [(name, None), ("sql", name)] for m in models):
                break
            asyncio.run(asyncio.sleep(0.5))
        assert models == [[(name, None), ("sql", name)]] * 6

    before = {rid: s.num_requests_total for rid, s in worker_stats(APP).items()}

    async def completions() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            body = {"model": "sql", "prompt": "one two three four", "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(CONCURRENT)))

    responses = asyncio.run(completions())
    assert [r.status_code for r in responses] == [200] * CONCURRENT, responses[0].text
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1  # greedy: one answer whoever ran it
    assert {r.json()["model"] for r in responses} == {"sql"}
    served = {rid: s.num_requests_total - before.get(rid, 0) for rid, s in worker_stats(APP).items()}
    assert len(served) == 2 and sum(served.values()) == CONCURRENT
    assert all(n > 0 for n in served.values()), served  # both workers ran the adapter: neither failed

    with httpx.Client(base_url=base, timeout=120) as http:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        for _ in range(20):
            codes = {http.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 1}).status_code
                     for _ in range(4)}
            if codes == {404}:
                break
            asyncio.run(asyncio.sleep(0.25))
        assert codes == {404}
