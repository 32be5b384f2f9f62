"""Runtime LoRA adapters through the real OpenAI app, the ingress's worker client and worker replicas
(Serve's handle stood in for by direct calls, the app-wide registry by its plain object): vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter with their status codes and messages, an adapter
loaded through one ingress served by another and by a worker replica that never saw the load, its
greedy output equal to transformers + PEFT's, and an adapter a worker lacks reaching the client as
a 404 ``model_not_found``."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pagefleet.cluster.config import ServeArgs, ServeOptions
from pagefleet.router.ingress import HandleWorkerClient, load_model_info
from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.errors import OpenAIError
from pagefleet.router.openai.lora_adapters import LoRARegistry, RuntimeLoRAs
from pagefleet.router.openai.service import Job, OpenAIService
from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams
from pagefleet.worker.lora.request import LoRAModulePath
from pagefleet.worker.replica.deployment import WorkerReplica

from channel_fakes import ReplicaHandle, until
from lora_helpers import ADAPTERS, peft_greedy, write_adapter

NAME = "llama"  # the tiny checkpoint's directory, the name it is served under
PROMPT = "one two three four five six seven"
MAX_TOKENS = 8
KEY = "sk-lora"


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    sql = write_adapter(base, root / "sql", *ADAPTERS["sql"])  # r=4
    chat = write_adapter(base, root / "chat", *ADAPTERS["chat"])  # r=8: over max_lora_rank 4
    return {"sql": str(sql), "chat": str(chat), "missing": str(root / "missing")}


@pytest.fixture(scope="module")
def args(base):
    return EngineArgs(model=str(base), dtype="float32", device="cpu", max_model_len=256, kv_cache_bytes=16 << 20,
                      enable_lora=True, max_loras=2, max_lora_rank=4)


@pytest.fixture(scope="module")
def engines(args):
    """Two engines, each a worker replica's: built once, fresh replicas over them in each test."""
    built = [AsyncLLMEngine(args), AsyncLLMEngine(args)]
    yield built
    for engine in built:
        engine.shutdown()


class _Replica(WorkerReplica):
    def __del__(self) -> None:  # the module's engines outlive each test's replicas (``Ingress.close``)
        pass


class Ingress:
    """One ingress replica: its service and app over a worker replica, following ``registry``."""

    def __init__(self, args: EngineArgs, engine: AsyncLLMEngine, registry: LoRARegistry | None,
                 api_key: str | None = None) -> None:
        tokenizer, info = load_model_info(args)
        self.replica = _Replica(args, engine_factory=lambda _: engine)
        self.client = HandleWorkerClient(ReplicaHandle(self.replica))
        self.service = OpenAIService(tokenizer=tokenizer, info=info, client=self.client)
        self.loras = None if registry is None else RuntimeLoRAs(registry, self.service.runtime_loras,
                                                                self.client.load_lora).start()
        app = build_openai_app(self.service, api_key=api_key, runtime_loras=self.loras)
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")

    async def close(self) -> None:
        await self.http.aclose()
        if self.loras is not None and self.loras._follower is not None:
            self.loras._follower.cancel()
        self.replica._channel_server.close()


async def _completion_ids(ingress: Ingress, model: str) -> tuple[int, dict]:
    r = await ingress.http.post("/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})
    body = r.json()
    if r.status_code != 200:
        return r.status_code, body
    return 200, {"model": body["model"],
                 "ids": [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]}


def _model_ids(response: httpx.Response) -> list[tuple[str, str | None]]:
    assert response.status_code == 200, response.text
    return [(m["id"], m["parent"]) for m in response.json()["data"]]


def test_loaded_through_one_ingress_served_by_another_and_by_a_replica_that_never_saw_the_load(
        args, engines, adapters, base):
    tokenizer, _ = load_model_info(args)
    prompt_ids = tuple(tokenizer.encode(PROMPT))
    want_sql, want_base = peft_greedy(str(base), adapters["sql"], prompt_ids, MAX_TOKENS), peft_greedy(
        str(base), None, prompt_ids, MAX_TOKENS)
    assert want_sql != want_base  # the adapter steers this prompt: the comparison below means something

    async def run() -> None:
        registry = LoRARegistry()
        a, b = Ingress(args, engines[0], registry), Ingress(args, engines[1], registry)
        try:
            assert engines[0].engine.lora_held("sql") is None and engines[1].engine.lora_held("sql") is None
            r = await a.http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["sql"]})
            assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
            # The load read and checked it on one worker replica (a's); b's engine has not seen it.
            assert engines[0].engine.lora_held("sql").lora_path == adapters["sql"]
            assert engines[1].engine.lora_held("sql") is None
            assert _model_ids(await a.http.get("/v1/models")) == [(NAME, None), ("sql", NAME)]
            await until(lambda: "sql" in b.service.runtime_loras)  # b follows the registry
            assert _model_ids(await b.http.get("/v1/models")) == [(NAME, None), ("sql", NAME)]

            assert await _completion_ids(a, "sql") == (200, {"model": "sql", "ids": want_sql})
            # b's worker registers the adapter from the path its request carries, then runs it.
            assert await _completion_ids(b, "sql") == (200, {"model": "sql", "ids": want_sql})
            assert engines[1].engine.lora_held("sql").lora_path == adapters["sql"]
            assert await _completion_ids(b, NAME) == (200, {"model": NAME, "ids": want_base})

            r = await b.http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
            await until(lambda: "sql" not in a.service.runtime_loras)
            for ingress in (a, b):
                assert _model_ids(await ingress.http.get("/v1/models")) == [(NAME, None)]
                status, body = await _completion_ids(ingress, "sql")
                assert status == 404
                assert body["error"] == {"message": f"The model `sql` does not exist. This server serves `{NAME}`.",
                                         "type": "not_found_error", "param": "model", "code": "model_not_found"}
            r = await a.http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert r.status_code == 404
            assert r.json()["error"]["message"] == "The lora adapter 'sql' cannot be found."
            # Loaded again from its path: served again. Another path under its name is refused.
            r = await a.http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["sql"]})
            assert r.status_code == 200
            assert await _completion_ids(a, "sql") == (200, {"model": "sql", "ids": want_sql})
            r = await a.http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert r.status_code == 200
            stats = engines[0].stats()
            assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


def test_unload_lets_the_requests_running_with_it_finish(args, engines, adapters):
    """As vLLM: unloading takes the name away from new requests at once; running ones finish."""

    async def run() -> None:
        a = Ingress(args, engines[0], LoRARegistry())
        try:
            r = await a.http.post("/v1/load_lora_adapter", json={"lora_name": "live", "lora_path": adapters["sql"]})
            assert r.status_code == 200
            running = asyncio.ensure_future(a.http.post("/v1/completions", json={
                "model": "live", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}))
            await until(lambda: engines[0].stats().num_running == 1 or running.done(), timeout_s=30)
            assert not running.done(), running.result().text
            r = await a.http.post("/v1/unload_lora_adapter", json={"lora_name": "live"})
            assert r.status_code == 200
            assert (await _completion_ids(a, "live"))[0] == 404
            assert not running.done()  # still running with the adapter its name no longer gives
            done = await running
            assert done.status_code == 200
            body = done.json()
            assert (body["model"], body["usage"]["completion_tokens"]) == ("live", 200)
        finally:
            await a.close()

    asyncio.run(run())


def test_a_bad_adapter_is_a_400_with_the_reason_and_changes_nothing(args, engines, adapters):
    async def run() -> None:
        registry = LoRARegistry()
        a = Ingress(args, engines[0], registry)
        try:
            async def load(body: dict) -> tuple[int, dict]:
                r = await a.http.post("/v1/load_lora_adapter", json=body)
                return r.status_code, r.json()["error"]

            status, error = await load({"lora_name": "chat", "lora_path": adapters["chat"]})
            assert (status, error["message"]) == (
                400, f"Loading lora chat failed: {adapters['chat']}: rank 8 is over max_lora_rank 4")
            assert (error["type"], error["param"]) == ("invalid_request_error", "lora_path")
            status, error = await load({"lora_name": "gone", "lora_path": adapters["missing"]})
            assert (status, error["message"]) == (
                400, f"Loading lora gone failed: {adapters['missing']}: no adapter_config.json (a PEFT LoRA "
                     "checkpoint directory is expected)")
            assert (await load({"lora_name": "", "lora_path": adapters["sql"]})) == (400, {
                "message": "Both 'lora_name' and 'lora_path' must be provided.", "type": "invalid_request_error",
                "param": None, "code": None})
            status, error = await load({"lora_name": NAME, "lora_path": adapters["sql"]})
            assert (status, error["message"]) == (400, f"The lora adapter '{NAME}' conflicts with a served base "
                                                       "model.")
            status, error = await load({"lora_path": adapters["sql"]})
            assert (status, error["param"]) == (400, "lora_name")
            r = await a.http.post("/v1/load_lora_adapter", content=b"lora_name=x", headers={"content-type": "text/plain"})
            assert r.status_code == 415
            # Nothing changed: not listed, not served, not registered anywhere.
            assert _model_ids(await a.http.get("/v1/models")) == [(NAME, None)]
            assert registry.adapters == {} and registry.version == 0
            assert [engines[0].engine.lora_held(n) for n in ("chat", "gone")] == [None, None]
            assert (await _completion_ids(a, "chat"))[0] == 404

            # The same name from another path, while loaded and after an unload, is refused.
            r = await a.http.post("/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": adapters["sql"]})
            assert r.status_code == 200
            status, error = await load({"lora_name": "sql2", "lora_path": adapters["sql"]})
            assert (status, error["message"]) == (400, "The lora adapter 'sql2' has already been loaded.")
            assert (await a.http.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"})).status_code == 200
            status, error = await load({"lora_name": "sql2", "lora_path": adapters["missing"]})
            assert (status, error["message"]) == (400, f"Loading lora sql2 failed: LoRA adapter 'sql2' is served "
                                                       f"from {adapters['sql']}, not {adapters['missing']}")
            # A replica that never held it reads it; the registry still keeps the name to its path.
            fresh = Ingress(args, engines[1], registry)
            try:
                r = await fresh.http.post("/v1/load_lora_adapter",
                                          json={"lora_name": "sql2", "lora_path": adapters["sql"] + "/."})
                assert (r.status_code, r.json()["error"]["message"]) == (
                    400, f"The lora adapter 'sql2' was served from {adapters['sql']}; its name cannot name "
                         f"{adapters['sql']}/. while this server runs (KV blocks are cached under the name)")
            finally:
                await fresh.close()
        finally:
            await a.close()

    asyncio.run(run())


def test_without_the_switch_the_routes_are_a_404_and_with_a_key_they_need_it(args, engines, adapters):
    async def run() -> None:
        off = Ingress(args, engines[0], None)
        keyed = Ingress(args, engines[0], LoRARegistry(), api_key=KEY)
        try:
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                r = await off.http.post(path, json={"lora_name": "sql", "lora_path": adapters["sql"]})
                assert r.status_code == 404
                assert r.json()["error"]["type"] == "not_found_error"
            body = {"lora_name": "sql3", "lora_path": adapters["sql"]}
            r = await keyed.http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            r = await keyed.http.post("/v1/unload_lora_adapter", json={"lora_name": "sql3"})
            assert r.status_code == 401
            assert "sql3" not in keyed.service.runtime_loras
            r = await keyed.http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200
            r = await keyed.http.post("/v1/unload_lora_adapter", json={"lora_name": "sql3"},
                                      headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200
        finally:
            await off.close()
            await keyed.close()

    asyncio.run(run())


def test_the_switch_needs_enable_lora(base):
    with pytest.raises(ValueError, match="allow_runtime_lora_updating needs enable_lora"):
        ServeOptions(EngineArgs(model=str(base)), ServeArgs(allow_runtime_lora_updating=True))


def test_an_adapter_the_worker_lacks_is_a_404_model_not_found(args, engines):
    """A request naming an adapter with no path to read it from, on a replica whose engine lacks it:
    the engine's refusal becomes OpenAI's 404, not a 400."""

    async def run() -> OpenAIError:
        ingress = Ingress(args, engines[0], None)
        try:
            job = Job("ghost-0", [5, 6, 7], SamplingParams(max_tokens=2), lora_name="ghost")
            with pytest.raises(OpenAIError) as caught:
                async for _ in ingress.client.generate(job):
                    pass
            return caught.value
        finally:
            await ingress.close()

    error = asyncio.run(run())
    assert (error.status_code, error.code, error.param) == (404, "model_not_found", "model")
    assert error.body() == {"error": {"message": "no LoRA adapter named 'ghost' is loaded on this worker",
                                      "type": "not_found_error", "param": "model", "code": "model_not_found"}}


def test_an_ingress_takes_a_restarted_registrys_adapters_whatever_their_version():
    """Ray restarts a lost registry empty, at version 0: the ingress's copy follows it, not its own
    higher version."""

    async def checked(module: LoRAModulePath) -> None:
        pass

    async def run() -> None:
        adapters: dict[str, LoRAModulePath] = {}
        loras = RuntimeLoRAs(LoRARegistry(), adapters, checked)
        await loras.load(LoRAModulePath("a", "/a"))
        await loras.load(LoRAModulePath("b", "/b"))
        assert (sorted(adapters), loras.version) == (["a", "b"], 2)
        restarted = LoRARegistry()
        await restarted.add(LoRAModulePath("c", "/c"))
        loras.registry = restarted
        loras.start()
        try:
            await until(lambda: sorted(adapters) == ["c"])
            assert (loras.epoch, loras.version) == (restarted.epoch, 1)
        finally:
            loras._follower.cancel()

    asyncio.run(run())
