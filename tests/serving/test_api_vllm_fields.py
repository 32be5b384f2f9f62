"""vLLM's request fields beyond OpenAI's, over the real FastAPI app with a scripted worker: each
reaches the engine as vLLM means it (the engine's own effect is held to transformers in
tests/worker/test_logits_processors.py and through the real server in test_structured_cluster)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.service import OpenAIService

from serving_fakes import CHAT_TEMPLATE, MODEL, FakeWorkerClient, fake_token, make_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog"


def test_logits_processors_reach_the_engine(client, fake):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 300, "7": -2.5},
                                             "allowed_token_ids": [3, 4, 5], "bad_words": ["fox", "lazy dog"],
                                             "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    (_, _, params), = fake.requests
    assert params.logit_bias == {5: 100.0, 7: -2.5}  # clamped to [-100, 100], as vLLM
    assert (params.allowed_token_ids, params.bad_words, params.skip_special_tokens) == ([3, 4, 5],
                                                                                        ["fox", "lazy dog"], False)


def test_truncate_prompt_tokens_keeps_the_last_or_first_k(client, fake, tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 5
    for body, kept in (({"truncate_prompt_tokens": 4}, ids[-4:]),
                       ({"truncate_prompt_tokens": 4, "truncation_side": "right"}, ids[:4]),
                       ({"truncate_prompt_tokens": -1}, ids)):
        fake.requests.clear()
        r = client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        assert fake.requests[0][1] == kept
        assert r.json()["usage"]["prompt_tokens"] == len(kept)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": TEXT}], "max_tokens": 1,
                                                  "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and len(fake.requests[-1][1]) == 3
    r = client.post("/v1/completions", json={"prompt": TEXT, "truncate_prompt_tokens": 65})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "truncate_prompt_tokens")


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, tokenizer):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 1,
                                             "return_tokens_as_token_ids": True, "temperature": 0})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("hi")
    expected = [fake_token(ids, s, 0, len(tokenizer)) for s in range(2)]
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in expected]
    assert list(logprobs["top_logprobs"][0]) == [f"token_id:{expected[0]}"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                  "logprobs": True, "return_tokens_as_token_ids": True})
    entry = r.json()["choices"][0]["logprobs"]["content"][0]
    assert entry["token"].startswith("token_id:") and entry["bytes"] == list(entry["token"].encode())


def test_chat_template_kwargs_reach_the_template():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %} no{% endif %}"
    fake = FakeWorkerClient(tokenizer, vocab_size=len(tokenizer))
    from pagefleet.router.openai.preprocess import ModelInfo
    from pagefleet.worker.request_check import RequestLimits

    info = ModelInfo(served_model_name=MODEL, limits=RequestLimits(vocab_size=len(tokenizer), max_model_len=64,
                                                                   max_num_seqs=8))
    with TestClient(build_openai_app(OpenAIService(tokenizer=tokenizer, info=info, client=fake))) as client:
        messages = [{"role": "user", "content": "hi"}]
        for kwargs in (None, {"enable_thinking": True}, {"enable_thinking": False}):
            r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                          "chat_template_kwargs": kwargs})
            assert r.status_code == 200, r.text
        plain, thinking, not_thinking = (tokenizer.decode(ids) for _, ids, _ in fake.requests)
        assert plain == thinking == "<s>user: hi\n<s>assistant:"
        assert not_thinking == plain + " no"
        for bad in ({"messages": []}, {"add_generation_prompt": False}, {"x": "y" * 5000}):
            r = client.post("/v1/chat/completions", json={"messages": messages, "chat_template_kwargs": bad})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "chat_template_kwargs")


def test_the_fronts_client_address_keys_the_per_client_bounds(client, fake):
    """Behind HAProxy every request comes from HAProxy's address: the client's own, which HAProxy
    sets in X-Pagefleet-Client, is whose share of a worker's compile queue a request takes."""
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                headers={"X-Pagefleet-Client": "203.0.113.7"})
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert [job.client for job in fake.routed] == ["203.0.113.7", "testclient"]
