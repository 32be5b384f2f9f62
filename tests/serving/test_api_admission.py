"""Where the API meets routing: prompt hashes with cache_salt, and admission control's 429
(over the real FastAPI app with a scripted worker)."""

from pagefleet.router.openai.errors import too_many_requests
from pagefleet.worker.core.block_hash import block_hashes, extra_keys_digest, pack_hashes

from serving_fakes import MODEL

PROMPT = list(range(10, 50))  # 40 token ids: 2 full blocks of 16 and 8 tokens


def test_prompt_blocks_are_hashed_once_at_the_ingress_with_the_cache_salt(client, fake):
    for salt in (None, "tenant-1", "tenant-2"):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        if salt is not None:
            body["cache_salt"] = salt
        assert client.post("/v1/completions", json=body).status_code == 200
    plain, one, two = fake.routed
    assert plain.block_hashes == pack_hashes(block_hashes(PROMPT, 16)) and plain.extra_keys == ()
    assert one.block_hashes == pack_hashes(block_hashes(PROMPT, 16, extra_keys_digest(("tenant-1",))))
    assert one.extra_keys == ("tenant-1",)
    assert len({plain.block_hashes, one.block_hashes, two.block_hashes}) == 3  # no two tenants share a block
    assert len(plain.block_hashes) == 2 * 16  # full blocks only
    short = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT[:15], "max_tokens": 1})
    assert short.status_code == 200 and fake.routed[-1].block_hashes == b""


def test_an_empty_cache_salt_is_refused(client, fake):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert fake.requests == []


def test_admission_refusal_is_a_429_with_retry_after_before_any_stream_starts(client, fake):
    fake.refuse = too_many_requests("all workers are full", 3)
    for stream in (False, True):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4,
                                                 "stream": stream})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "3"
        assert r.json() == {"error": {"message": "all workers are full", "type": "requests", "param": None,
                                      "code": "rate_limit_exceeded"}}
    assert fake.requests == []  # nothing reached a worker
    fake.refuse = None
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1}).status_code == 200


def test_a_full_admission_queue_refuses_before_the_body_is_read(client, fake):
    fake.refuse_early = too_many_requests("all workers are full and 64 requests are already waiting", 2)
    # not even valid JSON: a 429, not a 400, because the body is never read or parsed
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=b"{not json", headers={"Content-Type": "application/json"})
        assert (r.status_code, r.headers["retry-after"], r.json()["error"]["code"]) == (429, "2",
                                                                                       "rate_limit_exceeded")
    assert fake.routed == [] and fake.requests == []  # nothing was tokenized, routed or sent
    assert client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}).status_code == 200  # only generation
    fake.refuse_early = None
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1}).status_code == 200
