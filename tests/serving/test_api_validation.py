"""Bad requests get OpenAI-shaped 4xx errors and never reach a worker."""

import pytest

from serving_fakes import MAX_MODEL_LEN

LONG_IDS = list(range(2, 2 + MAX_MODEL_LEN))


def _error(r, status, param):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["param"] == param
    return body["error"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "logit_bias": {"x": 1.0}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 1.0, "100000": 2.0}}, 400, "logit_bias"),
    ({"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ({"prompt": "hi", "priority": 3}, 400, "priority"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ({"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [True, False]}, 400, "prompt"),
    ({"prompt": 12}, 400, "prompt"),
    ({"prompt": [10**6]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": LONG_IDS, "max_tokens": 1}, 400, "prompt"),
    ({"prompt": LONG_IDS[:60], "max_tokens": 5}, 400, "max_tokens"),
    ({}, 400, "prompt"),
])
def test_bad_completion_requests(client, fake, body, status, param):
    _error(client.post("/v1/completions", json=body), status, param)
    assert fake.requests == []


def test_prompt_that_exactly_fits_is_accepted(client, fake):
    r = client.post("/v1/completions", json={"prompt": LONG_IDS[:60], "max_tokens": 4})
    assert r.status_code == 200
    assert fake.requests[0][2].max_tokens == 4


def test_prompt_without_max_tokens_fills_the_context(client, fake):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    (_, ids, params), = fake.requests
    assert params.max_tokens == MAX_MODEL_LEN - len(ids)


CHAT_OK = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "messages": CHAT_OK}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.[0].content"),
    ({"messages": [{"content": "x"}]}, 400, "messages.[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.[0].content.[0].type"),
    ({"messages": CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": CHAT_OK, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ({"messages": CHAT_OK, "logprobs": 1}, 400, "logprobs"),
    ({"messages": CHAT_OK, "max_completion_tokens": 1000}, 400, "max_completion_tokens"),
    ({"messages": CHAT_OK, "max_tokens": 1000}, 400, "max_tokens"),
    # this tokenizer's template never reads tools
    ({"messages": CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"messages": CHAT_OK, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400,
     "tools.[0].function.name"),
    ({"messages": CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400, "tools"),
    ({"messages": CHAT_OK, "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({"messages": CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
     400, "tool_choice"),  # this server has no --enable-auto-tool-choice
    ({"messages": CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ({"messages": CHAT_OK, "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"messages": CHAT_OK, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ({"messages": CHAT_OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     400, "response_format"),
    ({"messages": CHAT_OK, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
     400, "structured_outputs"),
    ({"messages": CHAT_OK, "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400, "structured_outputs"),
    ({"messages": CHAT_OK, "structured_outputs": {"choice": []}}, 400, "structured_outputs"),
    ({"messages": CHAT_OK, "structured_outputs": {"json": "{not json"}}, 400, "structured_outputs"),
    ({"messages": CHAT_OK, "structured_outputs": {"grammar": "x" * 70_000}}, 400, "structured_outputs"),
    ({"messages": CHAT_OK, "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message"),
    ({"messages": "hello"}, 400, "messages"),
])
def test_bad_chat_requests(client, fake, body, status, param):
    _error(client.post("/v1/chat/completions", json=body), status, param)
    assert fake.requests == []


def test_unparseable_bodies(client, fake):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    _error(r, 400, None)
    r = client.post("/v1/completions", json=[1, 2])
    _error(r, 400, None)
    assert fake.requests == []


def test_unknown_route_and_method_are_openai_shaped(client):
    err = _error(client.get("/v1/nothing"), 404, None)
    assert err["type"] == "not_found_error"
    _error(client.get("/v1/completions"), 405, None)


def test_chat_template_error_is_a_400(tokenizer, info, fake):
    from fastapi.testclient import TestClient

    from pagefleet.router.openai.app import build_openai_app
    from pagefleet.router.openai.service import OpenAIService

    tok = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}x"
    service = OpenAIService(tokenizer=tok, info=info, client=fake)
    with TestClient(build_openai_app(service)) as c:
        err = _error(c.post("/v1/chat/completions", json={"messages": CHAT_OK}), 400, "messages")
    assert "system first" in err["message"]
    assert fake.requests == []


def test_api_key_guards_the_openai_routes(service):
    from fastapi.testclient import TestClient

    from pagefleet.router.openai.app import build_openai_app

    with TestClient(build_openai_app(service, api_key="s3cret")) as c:
        err = _error(c.get("/v1/models"), 401, None)
        assert err["code"] == "invalid_api_key"
        _error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, None)
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_json_numbers_are_refused(client, fake, constant):
    r = client.post("/v1/completions", content='{"prompt": "hi", "temperature": %s}' % constant,
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert constant in r.json()["error"]["message"]
    assert fake.requests == []
