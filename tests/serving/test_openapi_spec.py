"""/openapi.json describes what the server accepts and answers; the fixes schemathesis led to."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.http_guards import parse_json_object

from serving_fakes import MAX_MODEL_LEN

LONG_IDS = [5] * (MAX_MODEL_LEN - 1)


def _schema(service, api_key=None) -> dict:
    with TestClient(build_openai_app(service, api_key=api_key)) as c:
        r = c.get("/openapi.json", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    assert r.status_code == 200
    return r.json()


def test_request_bodies_are_the_protocol_models_narrowed_to_this_servers_limits(service, info):
    schema = _schema(service)
    post = schema["paths"]["/v1/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    body = schema["components"]["schemas"]["CompletionRequest"]
    assert body["required"] == ["prompt"]
    n = body["properties"]["n"]
    assert (n["minimum"], n["maximum"]) == (1, info.limits.max_num_seqs)
    token_ids = body["properties"]["prompt"]["anyOf"][2]
    assert token_ids["items"] == {"type": "integer", "minimum": 0, "maximum": info.limits.vocab_size - 1}
    assert body["properties"]["echo"]["type"] == "boolean"
    for path in ("/v1/chat/completions", "/tokenize", "/detokenize"):
        assert "requestBody" in schema["paths"][path]["post"]



def test_priority_is_described_as_the_servers_scheduling_policy_takes_it(service, info):
    fcfs = _schema(service)["components"]["schemas"]["CompletionRequest"]["properties"]["priority"]
    assert (fcfs["const"], fcfs["default"]) == (0, 0)  # anything else is a 400 on an fcfs server
    service.info = dataclasses.replace(info, limits=dataclasses.replace(info.limits, scheduling_policy="priority"))
    ranked = _schema(service)["components"]["schemas"]["ChatCompletionRequest"]["properties"]["priority"]
    assert (ranked["minimum"], ranked["maximum"], "const" in ranked) == (-(2**63), 2**63 - 1, False)

def test_responses_list_every_status_in_the_openai_error_shape_and_401_only_with_a_key(service):
    plain = _schema(service)["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert sorted(plain) == ["200", "400", "404", "413", "415", "429", "500", "503"]
    assert plain["429"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(plain["200"]["content"]) == {"application/json", "text/event-stream"}
    keyed = _schema(service, api_key="k")
    responses = keyed["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "401" in responses and keyed["paths"]["/v1/chat/completions"]["post"]["security"] == [{"APIKey": []}]
    assert keyed["components"]["securitySchemes"]["APIKey"]["scheme"] == "bearer"
    assert "401" not in keyed["paths"]["/health"]["get"]["responses"]
    error = keyed["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_a_wrong_method_is_405_with_allow(client):
    r = client.delete("/v1/completions")
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw, value", [(b"5.0", 5), (b"1e2", 100), (b"-0.0", 0), (b"2.5", 2.5),
                                        (b"5.0000000000000001", 5.0), (b"1e300", 1e300)])
def test_a_whole_json_number_is_an_integer(raw, value):
    parsed = parse_json_object(b'{"x": ' + raw + b"}")["x"]
    assert parsed == value and type(parsed) is type(value)


def test_max_tokens_written_as_a_whole_float_is_accepted(client, fake):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3.0})
    assert r.status_code == 200, r.text
    assert fake.requests[-1][2].max_tokens == 3


@pytest.mark.parametrize("body, param", [
    ({"prompt": LONG_IDS + [5], "max_tokens": 1}, "prompt"),
    ({"prompt": LONG_IDS[:60], "max_tokens": 5}, "max_tokens"),
])
def test_a_prompt_that_does_not_fit_is_context_length_exceeded(client, fake, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
    assert fake.requests == []


def test_responses_documents_its_body_its_answer_and_its_named_events(service, info):
    schema = _schema(service)
    post = schema["paths"]["/v1/responses"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesRequest"}
    ok = post["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/ResponseObject"}
    assert ok["text/event-stream"]["itemSchema"]["required"] == ["event", "data"]
    body = schema["components"]["schemas"]["ResponsesRequest"]
    assert body["additionalProperties"] is False  # anything else is refused, naming it
    assert body["properties"]["store"]["anyOf"][0] == {"const": False}
    tokens = body["properties"]["max_output_tokens"]["anyOf"][0]
    assert (tokens["minimum"], tokens["maximum"]) == (1, info.limits.max_model_len - 1)
    items = body["properties"]["input"]["anyOf"][1]["items"]["anyOf"]
    assert [item["required"] for item in items] == [["role", "content"], ["call_id", "name", "arguments", "type"],
                                                    ["call_id", "output", "type"]]
    answer = schema["components"]["schemas"]["ResponseObject"]
    assert answer["properties"]["status"]["enum"] == ["in_progress", "completed", "incomplete"]
