"""SSE exactly as OpenAI writes it, errors inside streams, and aborts when a stream closes."""

import asyncio
import json

from serving_fakes import fake_token

MESSAGES = [{"role": "user", "content": "hello world"}]


def _events(client, path, body):
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert all(e.startswith("data: ") for e in events[:-1])
    assert raw.count("data: [DONE]") == 1
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


def test_completion_stream_is_one_chunk_per_step(client, tokenizer):
    chunks = _events(client, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "stream": True})
    ids = tokenizer.encode("hello")
    expected = [tokenizer.decode([fake_token(ids, s, 0, len(tokenizer))]) for s in range(3)]
    assert [c["choices"][0]["text"] for c in chunks] == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_chat_stream_opens_with_the_role_and_ends_with_usage(client, tokenizer):
    chunks = _events(client, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 2, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    *body, last = chunks
    assert last["choices"] == []
    prompt_len = len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                                    add_generation_prompt=True),
                                      add_special_tokens=False))
    assert last["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4, "total_tokens": prompt_len + 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["usage"] is None for c in body)
    text = {0: "", 1: ""}
    finish = {}
    for c in body[2:]:
        (choice,) = c["choices"]
        text[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert finish == {0: "length", 1: "length"}
    non_stream = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "n": 2}).json()
    assert [c["message"]["content"] for c in non_stream["choices"]] == [text[0], text[1]]


def test_error_mid_stream_is_an_error_event_then_done(client, fake, caplog):
    fake.fail_after_steps = 1
    chunks = _events(client, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "stream": True})
    assert len(chunks) == 2
    assert chunks[0]["choices"][0]["finish_reason"] is None
    assert set(chunks[1]) == {"error"}
    error = chunks[1]["error"]
    assert error["type"] == "internal_server_error"
    # The client gets an id to quote; the exception's text (paths, addresses) stays in the log.
    assert "engine step failed" not in error["message"]
    error_id = error["message"].split("error id ")[1].split(";")[0]
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert len(logged) == 1 and "engine step failed" in str(logged[0].exc_info[1])


def test_worker_failure_without_stream_is_a_500_in_openai_shape(client, fake):
    fake.fail_after_steps = 0
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal_server_error"
    assert "engine step failed" not in r.json()["error"]["message"]


def test_closing_a_stream_aborts_every_request_under_it(service, fake):
    async def run():
        fake.step_gate = asyncio.Event()  # hold every request after its first step
        from pagefleet.router.openai.protocol import CompletionRequest
        prepared = await service.completion(CompletionRequest(prompt=["hello", "world"], max_tokens=5, stream=True))
        chunks = service.stream_chunks(prepared)
        first = await chunks.__anext__()
        await chunks.aclose()
        return first

    first = asyncio.run(run())
    assert first["choices"][0]["finish_reason"] is None
    ids = sorted(r[0] for r in fake.requests)
    assert len(ids) == 2
    assert sorted(fake.aborted) == ids


def test_a_finished_choice_is_reported_once_while_its_siblings_run(client, fake):
    fake.stagger = True  # choice 1 stops after 2 tokens, choice 0 runs to 3
    chunks = _events(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "n": 2, "stream": True})
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks
                if c["choices"][0]["finish_reason"]]
    assert finishes == [(1, "stop"), (0, "length")]
    per_choice = [sum(1 for c in chunks[2:] if c["choices"][0]["index"] == i) for i in (0, 1)]
    assert per_choice == [3, 2]
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "n": 2}).json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"]["completion_tokens"] == 5
