"""/v1/completions and /v1/models over the real FastAPI app with a scripted worker."""

import platform

from prometheus_client.parser import text_string_to_metric_families

from serving_fakes import MODEL, fake_token


def test_models_lists_the_served_model(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == 64
    assert body["data"][0]["owned_by"] == "pagefleet"


def test_string_prompt_runs_to_length_with_exact_usage(client, fake, tokenizer):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 5,
                                             "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    ids = tokenizer.encode("hello world")
    expected = [fake_token(ids, s, 0, len(tokenizer)) for s in range(5)]
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == MODEL
    assert len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["index"] == 0
    assert choice["text"] == "".join(tokenizer.decode([t]) for t in expected)
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5, "total_tokens": len(ids) + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    (req_id, prompt_ids, params), = fake.requests
    assert prompt_ids == ids
    assert params.max_tokens == 5 and params.temperature == 0.0 and params.n == 1


def test_model_may_be_omitted(client, fake):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert r.status_code == 200
    assert len(fake.requests) == 1


def test_prompt_shapes_and_choice_indices(client, fake, tokenizer):
    # two prompts x n=2: choices are numbered prompt-major, as OpenAI does
    r = client.post("/v1/completions", json={"prompt": ["hello", "the dog"], "n": 2, "max_tokens": 2})
    assert r.status_code == 200
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    p0, p1 = tokenizer.encode("hello"), tokenizer.encode("the dog")
    assert [ids for _, ids, _ in fake.requests] == [p0, p1]
    assert body["choices"][3]["text"] == "".join(
        tokenizer.decode([fake_token(p1, s, 1, len(tokenizer))]) for s in range(2))
    assert body["usage"]["prompt_tokens"] == len(p0) + len(p1)
    assert body["usage"]["completion_tokens"] == 8

    fake.requests.clear()
    assert client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": [[5, 6], [9]], "max_tokens": 1}).status_code == 200
    assert [ids for _, ids, _ in fake.requests] == [[5, 6, 7], [5, 6], [9]]


def test_sampling_fields_reach_sampling_params(client, fake):
    r = client.post("/v1/completions", json={
        "prompt": "hello", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "seed": 123,
        "stop": "fox", "ignore_eos": True, "min_tokens": 2, "user": "alice", "stop_token_ids": [1]})
    assert r.status_code == 200
    p = fake.requests[0][2]
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.9, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.seed, p.stop, p.ignore_eos, p.min_tokens, p.stop_token_ids) == (123, ["fox"], True, 2, [1])
    assert p.logprobs is None


def test_completion_logprobs_legacy_format(client, tokenizer):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    ids = tokenizer.encode("hello")
    toks = [fake_token(ids, s, 0, len(tokenizer)) for s in range(2)]
    strs = [tokenizer.decode([t]) for t in toks]
    assert lp["tokens"] == strs
    assert lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["text_offset"] == [0, len(strs[0])]
    assert lp["top_logprobs"][0] == {strs[0]: -0.5, tokenizer.decode([toks[0] + 1]): -1.5}


def test_cached_tokens_are_reported(service, tokenizer, info):
    from fastapi.testclient import TestClient

    from pagefleet.router.openai.app import build_openai_app
    service.client.num_cached_tokens = 16
    with TestClient(build_openai_app(service)) as c:
        body = c.post("/v1/completions", json={"prompt": ["hello", "world"], "max_tokens": 1}).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


def test_version_and_metrics(client):
    assert client.get("/version").json() == {"version": "0.1.0"}
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    (info,) = families["python_info"].samples  # prometheus_client's default registry, rendered for real
    assert info.labels["version"] == platform.python_version()


def test_health_reflects_the_workers(client, fake):
    assert client.get("/health").status_code == 200
    fake.healthy = False
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable_error"
