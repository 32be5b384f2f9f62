"""/v1/chat/completions, /tokenize and /detokenize with a scripted worker."""

from serving_fakes import MODEL, fake_token

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def _template_ids(tokenizer, messages, add_generation_prompt=True):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_applies_the_template_and_answers(client, fake, tokenizer):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    ids = _template_ids(tokenizer, MESSAGES)
    assert fake.requests[0][1] == ids
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "".join(
        tokenizer.decode([fake_token(ids, s, 0, len(tokenizer))]) for s in range(3))}
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 3


def test_text_parts_and_generation_prompt_switch(client, fake, tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 1, "add_generation_prompt": False})
    assert fake.requests[0][1] == _template_ids(tokenizer, [{"role": "user", "content": "hello\nworld"}],
                                                add_generation_prompt=False)


def test_max_completion_tokens_wins_over_max_tokens(client, fake):
    client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 2})
    assert fake.requests[0][2].max_tokens == 2


def test_chat_n_and_logprobs(client, fake, tokenizer):
    body = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 2, "n": 2, "logprobs": True, "top_logprobs": 3}).json()
    ids = _template_ids(tokenizer, MESSAGES)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    content = body["choices"][1]["logprobs"]["content"]
    tok = fake_token(ids, 0, 1, len(tokenizer))
    s = tokenizer.decode([tok])
    assert content[0]["token"] == s
    assert content[0]["logprob"] == -0.5
    assert content[0]["bytes"] == list(s.encode())
    # a zero-probability alternative is -9999.0, because JSON has no -Infinity
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.5, -9999.0]
    assert fake.requests[0][2].logprobs == 3
    assert body["usage"]["completion_tokens"] == 4


def test_logprobs_true_alone_returns_only_the_chosen_token(client, fake):
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "logprobs": True}).json()
    assert fake.requests[0][2].logprobs == 0
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_tokenize_and_detokenize(client, tokenizer, fake):
    r = client.post("/tokenize", json={"prompt": "hello world"})
    ids = tokenizer.encode("hello world")
    assert r.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids}
    r = client.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True})
    chat_ids = _template_ids(tokenizer, MESSAGES)
    assert r.json()["tokens"] == chat_ids
    assert r.json()["token_strs"] == tokenizer.convert_ids_to_tokens(chat_ids)
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hello world"}
    assert client.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert client.post("/tokenize", json={}).status_code == 400
    assert client.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
    assert fake.requests == []
