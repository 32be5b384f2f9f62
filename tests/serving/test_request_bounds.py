"""What one request may carry is capped, and checked before any work that grows with it
(security round 2: salts, conversations, sequences, token ids)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.node_metrics import NodeMetricsReader
from pagefleet.router.openai.preprocess import MAX_CACHE_SALT_CHARS, ModelInfo, ServingLimits
from pagefleet.router.openai.service import OpenAIService
from pagefleet.worker.request_check import CONTEXT_LENGTH_EXCEEDED, InvalidRequest, RequestLimits, check_request
from pagefleet.worker.sampling_params import SamplingParams

from serving_fakes import MAX_MODEL_LEN, MODEL


def _error(r, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    return error


def test_a_cache_salt_longer_than_a_tenant_name_is_refused_before_hashing(client, fake):
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                              "cache_salt": "t" * MAX_CACHE_SALT_CHARS})
    assert ok.status_code == 200
    error = _error(client.post("/v1/completions", json={"prompt": "hi", "cache_salt": "t" * (2**19)}),
                   400, "cache_salt")
    assert str(MAX_CACHE_SALT_CHARS) in error["message"]
    assert len(fake.requests) == 1  # the refused one reached no worker


def test_prompts_times_n_are_capped_as_sequences(tokenizer, fake):
    info = ModelInfo(served_model_name=MODEL, serving=ServingLimits(max_prompts_per_request=8),
                     limits=RequestLimits(vocab_size=len(tokenizer), max_model_len=MAX_MODEL_LEN, max_num_seqs=8))
    with TestClient(build_openai_app(OpenAIService(tokenizer=tokenizer, info=info, client=fake))) as c:
        assert c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 4, "max_tokens": 1}).status_code == 200
        error = _error(c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 4}), 400, "n")
        assert "3 prompts x n=4" in error["message"] and "max_prompts_per_request" in error["message"]
    assert len(fake.requests) == 2  # the two prompts of the accepted request


def test_a_conversation_longer_than_max_chat_messages_is_refused_before_rendering(tokenizer, fake):
    info = ModelInfo(served_model_name=MODEL, serving=ServingLimits(max_chat_messages=4),
                     limits=RequestLimits(vocab_size=len(tokenizer), max_model_len=MAX_MODEL_LEN, max_num_seqs=8))
    rendered = []
    real_template = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda *a, **k: rendered.append(1) or real_template(*a, **k)
    try:
        with TestClient(build_openai_app(OpenAIService(tokenizer=tokenizer, info=info, client=fake))) as c:
            five = [{"role": "user", "content": ""}] * 5
            error = _error(c.post("/v1/chat/completions", json={"messages": five}), 400, "messages")
            assert "max_chat_messages" in error["message"]
            _error(c.post("/tokenize", json={"messages": five}), 400, "messages")
            assert rendered == []  # refused on its length alone
            assert c.post("/v1/chat/completions", json={"messages": five[:4], "max_tokens": 1}).status_code == 200
    finally:
        tokenizer.apply_chat_template = real_template
    assert rendered == [1]


def test_detokenize_takes_no_more_ids_than_a_sequence_holds(client):
    assert client.post("/detokenize", json={"tokens": [5] * MAX_MODEL_LEN}).status_code == 200
    error = _error(client.post("/detokenize", json={"tokens": [5] * (MAX_MODEL_LEN + 1)}), 400, "tokens")
    assert "max_model_len" in error["message"]


def test_a_prompt_too_long_is_refused_for_its_length_before_its_ids_are_scanned():
    limits = RequestLimits(vocab_size=100, max_model_len=64, max_num_seqs=8)
    with pytest.raises(InvalidRequest) as refused:
        check_request(list(range(10)) * 10 + [10**9], SamplingParams(max_tokens=1), limits)
    assert refused.value.code == CONTEXT_LENGTH_EXCEEDED  # not "token id ... outside the vocabulary"


def test_concurrent_scrapes_share_one_read_of_the_metrics_agent():
    reader = NodeMetricsReader(cache_s=0.5)
    release, reads = threading.Event(), []

    def slow_scrape() -> str:
        reads.append(1)
        release.wait(5)
        return "ray_pagefleet_x 1\n"

    reader._scrape = slow_scrape

    async def run():
        pages = [asyncio.ensure_future(reader.read()) for _ in range(60)]
        await asyncio.sleep(0.05)
        release.set()
        first = await asyncio.gather(*pages)
        again = await reader.read()  # within cache_s: the same page, no read
        return first, again

    first, again = asyncio.run(run())
    assert first == ["ray_pagefleet_x 1\n"] * 60 and again == first[0]
    assert len(reads) == 1
