"""Hostile bodies and limits at the ingress: each refused with a 4xx in the OpenAI shape, nothing
reaching a worker, and the server answering normally right after."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.http_guards import MAX_JSON_DEPTH, BodyLimits
from pagefleet.router.openai.preprocess import ModelInfo, ServingLimits
from pagefleet.router.openai.service import INLINE_TEXT_CHARS

JSON = {"Content-Type": "application/json"}


def _error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def _still_serves(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type", [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/json; charset=latin-1", "text/json", None,
])
def test_only_json_bodies_are_read(client, fake, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers)
    error = _error(r, 415, code="unsupported_media_type")
    assert "application/json" in error["message"] or "UTF-8" in error["message"]
    assert fake.requests == []
    _still_serves(client)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.api+json"])
def test_json_media_types_are_accepted(client, content_type):
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                    headers={"Content-Type": content_type})
    assert r.status_code == 200, r.text


def test_compressed_bodies_are_refused(client, fake):
    r = client.post("/v1/completions", content=b"\x1f\x8b...", headers={**JSON, "Content-Encoding": "gzip"})
    _error(r, 415)
    assert fake.requests == []


def test_body_over_the_limit_is_413_from_its_length_or_its_bytes(service, fake):
    with TestClient(build_openai_app(service, body_limits=BodyLimits(max_body_bytes=1000))) as c:
        big = b'{"prompt": "' + b"a" * 2000 + b'"}'
        error = _error(c.post("/v1/completions", content=big, headers=JSON), 413, code="request_too_large")
        assert "1000" in error["message"] and "max_request_body_bytes" in error["message"]

        def chunks():  # no Content-Length: the limit holds on the bytes as they arrive
            for _ in range(10):
                yield b" " * 300

        _error(c.post("/v1/completions", content=chunks(), headers=JSON), 413)
        _error(c.post("/v1/completions", content=b"{}", headers={**JSON, "Content-Length": "12abc"}), 400)
        assert fake.requests == []
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 10_000, 200_000])
def test_deep_nesting_is_a_400(client, fake, depth):
    body = '{"prompt": ' + "[" * depth + "]" * depth + "}"
    error = _error(client.post("/v1/completions", content=body, headers=JSON), 400,
                   param=None if depth > 900 else "prompt" + ".[0]" * (MAX_JSON_DEPTH - 1))
    assert f"nested more than {MAX_JSON_DEPTH} levels" in error["message"]
    deep_object = '{"prompt": "hi", "x": ' + '{"a": ' * depth + "1" + "}" * depth + "}"
    r = client.post("/v1/completions", content=deep_object, headers=JSON)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    assert fake.requests == []
    _still_serves(client)


def test_brackets_inside_strings_are_not_nesting(client):
    r = client.post("/v1/completions", json={"prompt": "[" * 20 + "{" * 20, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    (r'{"prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
    (r'{"prompt": ["ok", "\udfff"], "max_tokens": 2}', "prompt.[1]"),
    (r'{"prompt": "hi", "stop": ["\uDBFF"]}', "stop.[0]"),
    (r'{"prompt": "hi", "\ud83d": 1}', None),
])
def test_lone_surrogates_are_a_400(client, fake, body, param):
    error = _error(client.post("/v1/completions", content=body, headers=JSON), 400, param=param)
    assert "surrogate" in error["message"]
    assert fake.requests == []


def test_chat_message_with_a_lone_surrogate_names_the_message(client, fake):
    body = r'{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "\ud800"}]}'
    _error(client.post("/v1/chat/completions", content=body, headers=JSON), 400, param="messages.[1].content")
    assert fake.requests == []


def test_a_surrogate_pair_is_one_character(client, fake):
    r = client.post("/v1/completions", content=r'{"prompt": "smile \ud83d\ude00", "max_tokens": 2}', headers=JSON)
    assert r.status_code == 200, r.text
    assert fake.requests[0][1] == fake.tokenizer.encode("smile \U0001F600")


@pytest.mark.parametrize("body", [b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xed\xa0\x80"}'])
def test_invalid_utf8_is_a_400(client, fake, body):
    _error(client.post("/v1/completions", content=body, headers=JSON), 400)
    assert fake.requests == []


def _limited(service, **limits) -> TestClient:
    info = service.info
    service.info = ModelInfo(info.served_model_name, info.limits, ServingLimits(**limits))
    return TestClient(build_openai_app(service))


def test_prompts_per_request_are_bounded(service, fake):
    with _limited(service, max_prompts_per_request=4) as c:
        error = _error(c.post("/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 2}), 400, "prompt")
        assert "5 prompts" in error["message"] and "max_prompts_per_request" in error["message"]
        _error(c.post("/v1/completions", json={"prompt": [[5, 6]] * 5, "max_tokens": 2}), 400, "prompt")
        assert fake.requests == []
        assert c.post("/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 2}).status_code == 200


def test_prompt_text_is_bounded_before_tokenizing(service, fake, monkeypatch):
    encoded = []
    monkeypatch.setattr(fake.tokenizer, "encode", lambda text, **kw: encoded.append(text) or [5])
    with _limited(service, max_prompt_chars=1000) as c:
        error = _error(c.post("/v1/completions", json={"prompt": "a" * 1001}), 400, "prompt")
        assert "1001 characters" in error["message"] and "max_prompt_chars" in error["message"]
        messages = [{"role": "user", "content": "a" * 600}, {"role": "user", "content": "b" * 600}]
        _error(c.post("/v1/chat/completions", json={"messages": messages}), 400, "messages")
        _error(c.post("/tokenize", json={"prompt": "a" * 1001}), 400, "prompt")
    assert encoded == [] and fake.requests == []


def test_the_default_prompt_bound_never_refuses_a_prompt_that_fits(tokenizer_dir):
    from pagefleet.router.ingress import load_model_info
    from pagefleet.worker.engine_args import EngineArgs

    tokenizer, info = load_model_info(EngineArgs(model=str(tokenizer_dir), max_model_len=128))
    longest = max(tokenizer.get_vocab(), key=len)
    assert info.serving.max_prompt_chars == 128 * len(longest)
    # the worst case: every token as long as the vocabulary's longest
    text = tokenizer.convert_tokens_to_string([longest] * 127)
    assert len(text) <= info.serving.max_prompt_chars
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= 127


@pytest.mark.parametrize("request_id", ["x" * 129, "", "has space", "new\nline", "caf\u00e9", "\u202eevil"])
def test_request_id_length_and_characters(client, fake, request_id):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "request_id": request_id})
    error = _error(r, 400, "request_id")
    assert "max_request_id_chars" in error["message"]
    assert fake.requests == []


def test_request_id_is_the_servers_and_the_clients_is_only_echoed(client, fake):
    body = {"prompt": ["hi", "yo"], "max_tokens": 2, "request_id": "client-7"}
    a = client.post("/v1/completions", json=body)
    b = client.post("/v1/completions", json={**body, "stream": True})
    assert a.json()["id"] == "client-7"
    assert all('"id":"client-7"' in line for line in b.text.splitlines() if line.startswith("data: {"))
    engine_ids = [rid for rid, _, _ in fake.requests]
    assert len(engine_ids) == 4 and len(set(engine_ids)) == 4
    assert not any("client-7" in rid for rid in engine_ids)


def test_reusing_a_request_id_while_the_first_still_runs_gets_its_own_output(service, fake):
    """A client that reconnects with the same id must not get the old request's tail."""
    async def run():
        from pagefleet.router.openai.protocol import CompletionRequest

        fake.step_gate = asyncio.Event()
        old = service.stream_chunks(await service.completion(
            CompletionRequest(prompt=[5, 6, 7], max_tokens=4, stream=True, request_id="same")))
        await old.__anext__()  # the old request is running, held after its first step
        await old.aclose()     # the client hangs up...
        fake.step_gate.set()
        new = await service.run_to_completion(await service.completion(
            CompletionRequest(prompt=[9, 9], max_tokens=3, request_id="same")))
        return new

    new = asyncio.run(run())
    expected = fake.tokenizer.decode(fake.expected_tokens([9, 9], type("P", (), {"max_tokens": 3})(), 0))
    assert new["id"] == "same" and new["choices"][0]["text"] == expected
    (old_id, new_id) = [rid for rid, _, _ in fake.requests]
    assert old_id != new_id and fake.aborted == [old_id]


def test_models_shows_no_path(client):
    (model,) = client.get("/v1/models").json()["data"]
    assert model["root"] == model["id"] and "/" not in model["root"]


def test_long_text_is_tokenized_off_the_event_loop(client, fake, monkeypatch):
    threads = []
    real = fake.tokenizer.encode

    def encode(text, **kw):
        threads.append(threading.current_thread().name)
        return real(text, **kw)[:10]

    monkeypatch.setattr(fake.tokenizer, "encode", encode)
    assert client.post("/v1/completions", json={"prompt": "a" * INLINE_TEXT_CHARS, "max_tokens": 2}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "a" * (INLINE_TEXT_CHARS + 1),
                                                "max_tokens": 2}).status_code == 200
    loop_thread, off_thread = threads
    assert not loop_thread.startswith("pagefleet-tokenize")
    assert off_thread.startswith("pagefleet-tokenize")


def test_draining_refuses_new_requests_and_lets_in_flight_ones_finish(service, fake):
    async def run():
        from pagefleet.router.openai.protocol import CompletionRequest

        fake.step_gate = asyncio.Event()
        running = service.stream_chunks(await service.completion(
            CompletionRequest(prompt=[5, 6], max_tokens=3, stream=True)))
        first = await running.__anext__()
        drained = asyncio.create_task(service.drain(timeout_s=10))
        await asyncio.sleep(0.1)
        with pytest.raises(Exception) as refused:
            await service.completion(CompletionRequest(prompt=[5], max_tokens=2))
        fake.step_gate.set()
        rest = [c async for c in running]
        return first, rest, refused.value, await drained

    first, rest, refused, left = asyncio.run(run())
    assert (refused.status_code, refused.code, refused.retry_after_s) == (503, "draining", 5)
    assert rest[-1]["choices"][0]["finish_reason"] == "length" and left == 0
    assert service.num_in_flight == 0


def test_draining_answers_503_with_retry_after_over_http(service, client):
    service.draining = True
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    _error(r, 503, code="draining")
    assert r.headers["Retry-After"] == "5"
    assert client.get("/health").status_code == 503
