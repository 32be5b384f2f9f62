"""Structured outputs and tool calls through the real server and the real ``openai`` client.

The demo model has random weights: whatever it writes is valid only because the grammar let
nothing else through. Every request below is asked several times (seeds, temperatures, n) and
every answer must parse and validate, streamed or not.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from cluster_helpers import wait_until_running
from conftest import free_port

APP = "pagefleet-structured"
MAX_MODEL_LEN = 2048  # the demo checkpoint's own: a tools prompt alone is about 700 tokens
SEEDS = range(4)
# Room for any answer the grammars below allow: bounded strings, integers and arrays, and at most
# 32 whitespace characters between JSON tokens (a random model writes many).
JSON_TOKENS = 900


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_checkpoint):
    from ray import serve

    from pagefleet.cluster.app import build_app
    from pagefleet.router.global_scheduler.actor import stop_scheduler

    serve.shutdown()
    stop_scheduler()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    ckpt = tiny_checkpoint("llama")
    app = build_app({"model": str(ckpt), "workers": 1, "kv_cache_bytes": "16MiB", "max_model_len": MAX_MODEL_LEN,
                     "max_num_seqs": 8, "worker_num_cpus": 0.5, "ingress_num_cpus": 0.25,
                     "tool_call_parser": "hermes", "enable_auto_tool_choice": True})
    serve.run(app, name=APP, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_until_running(APP)
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    yield base, ckpt.name
    serve.shutdown()
    stop_scheduler()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    home: Address


def _chat(text: str = "Describe a person as JSON.") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_nested_pydantic_models_always_validates(server, client):
    _, model = server
    for seed in SEEDS:
        for temperature in (0.0, 1.0):
            r = client.chat.completions.parse(model=model, messages=_chat(), response_format=Person,
                                              max_tokens=JSON_TOKENS, temperature=temperature, seed=seed)
            (choice,) = r.choices
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
            assert Person.model_validate_json(choice.message.content) == choice.message.parsed


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok", "scores"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"},
                         "scores": {"type": "array", "maxItems": 4,
                                    "items": {"type": "integer", "minimum": -50, "maximum": 50}}}}


def test_raw_json_schema_with_n_and_streaming(server, client):
    _, model = server
    fmt = {"type": "json_schema", "json_schema": {"name": "result", "schema": SCHEMA, "strict": True}}
    for seed in SEEDS:
        r = client.chat.completions.create(model=model, messages=_chat(), response_format=fmt, n=3,
                                           max_tokens=JSON_TOKENS, temperature=1.0, seed=seed)
        for choice in r.choices:
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        stream = client.chat.completions.create(model=model, messages=_chat(), response_format=fmt, max_tokens=JSON_TOKENS,
                                                temperature=1.0, seed=seed, stream=True)
        jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)),
                            SCHEMA)


def test_vllms_structured_outputs_choice_regex_and_json_on_both_endpoints(server, client):
    _, model = server
    choices = ["positive", "negative", "neutral"]
    for seed in SEEDS:
        r = client.completions.create(model=model, prompt="Sentiment:", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
        r = client.chat.completions.create(model=model, messages=_chat("An IP address?"), max_tokens=40,
                                           temperature=1.0, seed=seed,
                                           extra_body={"structured_outputs": {"regex": r"(\d{1,3}\.){3}\d{1,3}"}})
        assert re.fullmatch(r"(\d{1,3}\.){3}\d{1,3}", r.choices[0].message.content)
        stream = client.completions.create(model=model, prompt="JSON:", max_tokens=JSON_TOKENS, temperature=1.0, seed=seed,
                                           stream=True, extra_body={"structured_outputs": {"json": SCHEMA}})
        jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), SCHEMA)


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _check_calls(calls, names=None) -> None:
    assert calls and all(re.fullmatch(r"call_\w{24}", c.id) for c in calls)
    for call in calls:
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_and_named_always_call_with_valid_arguments(server, client):
    _, model = server
    for seed in SEEDS:
        r = client.chat.completions.create(model=model, messages=_chat("Weather in Oslo?"), tools=TOOLS,
                                           tool_choice="required", max_tokens=JSON_TOKENS, temperature=1.0, seed=seed)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)
        r = client.chat.completions.create(model=model, messages=_chat("Time?"), tools=TOOLS, max_tokens=JSON_TOKENS,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=1.0, seed=seed, parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        _check_calls([call], {"get_time"})


def test_streamed_tool_calls_assemble_into_valid_calls(server, client):
    _, model = server
    for seed, choice in zip(SEEDS, ["required", {"type": "function", "function": {"name": "get_weather"}}] * 2):
        stream = client.chat.completions.create(model=model, messages=_chat("Weather?"), tools=TOOLS,
                                                tool_choice=choice, max_tokens=JSON_TOKENS, temperature=1.0, seed=seed,
                                                stream=True)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for d in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and calls
        for call in calls.values():
            assert re.fullmatch(r"call_\w{24}", call["id"])
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_tool_call_round_trip_renders_the_calls_and_results_in_the_history(server, client):
    _, model = server
    first = client.chat.completions.create(model=model, messages=_chat("Weather in Oslo?"), tools=TOOLS,
                                           tool_choice="required", max_tokens=JSON_TOKENS, seed=1)
    message = first.choices[0].message
    history = [*_chat("Weather in Oslo?"), message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": '{"forecast": "sun"}'} for c in message.tool_calls]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > first.usage.prompt_tokens
    tokens = httpx.post(f"{server[0]}/tokenize", json={"model": model, "messages": history, "tools": TOOLS}).json()
    text = httpx.post(f"{server[0]}/detokenize", json={"model": model, "tokens": tokens["tokens"]}).json()["prompt"]
    assert text.count("<tool_response>") == len(message.tool_calls)
    for call in message.tool_calls:
        assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": ' in text


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}}, "structured_outputs"),
])
def test_a_spec_that_does_not_compile_is_a_400_and_the_server_serves_on(server, client, extra, param):
    import openai

    _, model = server
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=_chat(), max_tokens=8, **extra)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    r = client.chat.completions.create(model=model, messages=_chat(), max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")


def test_an_empty_language_or_an_unenforced_keyword_is_a_400_naming_it(server, client):
    import openai

    base, model = server
    # The poison of issue 60's A1: every logit masked, once the engine loop's end.
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": "x", "max_tokens": 4, "temperature": 1, "logprobs": 1,
        "structured_outputs": {"regex": "[^\\s\\S]"}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "structured_outputs.regex allows no output at all (its language is empty)"
    assert r.json()["error"]["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=_chat(), max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert err.value.body["message"] == ('response_format.json_schema.schema.json uses "not" at $: '
                                         "xgrammar does not enforce it")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=_chat(), max_tokens=8, tools=tools, tool_choice="required")
    assert err.value.body["param"] == "tools.[0].function.parameters"
    assert err.value.body["message"] == ("the parameters of the function 'f' use \"multipleOf\" at $.properties.n: "
                                         'xgrammar enforces only a whole multipleOf of "type" integer')
    r = client.chat.completions.create(model=model, messages=_chat(), max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")


def test_vllm_logits_processors_and_prompt_fields_take_effect_through_the_server(server):
    """allowed_token_ids, logit_bias, bad_words, truncate_prompt_tokens and return_tokens_as_token_ids
    on the real engine: the token ids (read through return_tokens_as_token_ids) show each effect."""
    base, model = server

    def ids_of(**fields):
        body = {"model": model, "prompt": "the quick brown fox jumps over", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True, **fields}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        tokens = out["choices"][0]["logprobs"]["tokens"]
        assert all(t.startswith("token_id:") for t in tokens)
        return [int(t.split(":")[1]) for t in tokens], out["usage"]["prompt_tokens"]

    plain, prompt_tokens = ids_of()
    allowed = [11, 12, 13]
    assert set(ids_of(allowed_token_ids=allowed)[0]) <= set(allowed)
    assert ids_of(logit_bias={"77": 100})[0] == [77] * 6
    banned = ids_of(logit_bias={str(plain[0]): -100})[0]
    assert banned[0] != plain[0]
    assert ids_of(truncate_prompt_tokens=2)[1] == 2 < prompt_tokens
    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "hi", "use_beam_search": True},
                   timeout=60)
    assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) == (400, "use_beam_search",
                                                                                       "unsupported")


def test_echo_logprobs_of_a_prompt_equal_transformers_through_the_server(server, tiny_checkpoint):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 0) and vLLM's prompt_logprobs:
    the prompt tokens' logprobs equal transformers' log_softmax over the same prompt."""
    import torch
    from transformers import AutoTokenizer

    from hf_reference import hf_model

    base, model = server
    path = str(tiny_checkpoint("llama"))
    prompt = "the quick brown fox jumps over the lazy dog"
    ids = AutoTokenizer.from_pretrained(path).encode(prompt)
    with torch.no_grad():
        ref = hf_model(path)(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    want = [float(ref[j, ids[j + 1]]) for j in range(len(ids) - 1)]
    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "echo": True, "logprobs": 1,
                                                   "max_tokens": 0, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]) == (prompt, "length", 0)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-3)
    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "prompt_logprobs": 2,
                                                   "max_tokens": 2, "temperature": 0}, timeout=60)
    scored = r.json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    assert [entry[str(t)]["logprob"] for entry, t in zip(scored[1:], ids[1:])] == pytest.approx(want, abs=1e-3)
    assert all(len(entry) in (2, 3) for entry in scored[1:])  # the top 2, and the token when outside them


def test_a_compile_flood_from_one_client_leaves_others_their_answers(server):
    """Security round 3, A2, through the real server: one client (127.0.0.1) sends 6 schemas that
    take seconds each to compile; another (127.0.0.2) asks for a small grammar meanwhile and gets
    its answer in the quick lane, and GET /version stays fast. The flood's own requests each end
    as a 200, a 400 (its compile stopped at the time limit) or a 429 (its client's queue full)."""
    import concurrent.futures
    import time

    base, model = server

    def expensive(tag: str) -> dict:
        return {"model": model, "prompt": "x", "max_tokens": 2,
                "structured_outputs": {"json": {"type": "string", "pattern": f"^(a|bc|[0-9]{tag}){{1600,3200}}$"}}}

    small = {"model": model, "prompt": "Answer:", "max_tokens": 4, "temperature": 0,
             "structured_outputs": {"choice": ["yes", "no"]}}
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        flood = [pool.submit(httpx.post, f"{base}/v1/completions", json=expensive(tag), timeout=120)
                 for tag in "pqrstu"]
        time.sleep(1.0)  # the flood's compiles are running
        started = time.monotonic()
        answer = other.post(f"{base}/v1/completions", json=small)
        took = time.monotonic() - started
        version_s = []
        while not all(f.done() for f in flood):
            t0 = time.monotonic()
            assert httpx.get(f"{base}/version", timeout=10).status_code == 200
            version_s.append(time.monotonic() - t0)
            time.sleep(0.05)
        statuses = sorted(f.result().status_code for f in flood)
    assert (answer.status_code, answer.json()["choices"][0]["text"] in ("yes", "no")) == (200, True), answer.text
    assert took < 5.0  # not behind an expensive compile (each takes seconds)
    assert set(statuses) <= {200, 400, 429} and 429 in statuses, statuses  # 4 a client: the rest refused at once
    assert max(version_s) < 0.25, max(version_s)
