"""The whole server on a real local Ray cluster: deploy/serve.yaml brought up with `serve run`,
two worker replicas, driven with the real `openai` client and raw HTTP.

The app comes up once for this module (about a minute on two cores) and every test
below runs against it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from cluster_helpers import free_port as _free_port
from cluster_helpers import worker_stats

SERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"
APP = "pagefleet"
MAX_MODEL_LEN = 256
PROMPTS = ["Hello, my name is", "The capital of France is", "pagefleet serves models"]


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_checkpoint, tmp_path_factory):
    from ray import serve

    ckpt = tiny_checkpoint("llama")
    config = yaml.safe_load(SERVE_YAML.read_text())
    port = _free_port()
    config["http_options"]["port"] = port
    # Only sizes change: the shipped file, with a tiny checkpoint and CI-sized resources.
    config["applications"][0]["args"].update(model=str(ckpt), workers=2, kv_cache_bytes="16MiB",
                                             max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                             worker_num_cpus=0.5, ingress_num_cpus=0.25)
    path = tmp_path_factory.mktemp("serve") / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = str(Path(sys.executable).parent / "serve")
    done = subprocess.run([serve_cli, "run", "--address", ray_cluster, "--non-blocking", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            break
        assert status is None or status.status in ("DEPLOYING", "NOT_STARTED"), status
        assert time.monotonic() < deadline, f"app not RUNNING: {status}"
        time.sleep(1)
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    yield base, ckpt
    serve.delete(APP)


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ckpt_tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(server[1]))


def test_two_replicas_models_health_tokenize(server, openai_client, ckpt_tokenizer):
    base, ckpt = server
    assert len(worker_stats()) == 2
    models = openai_client.models.list().data
    assert [m.id for m in models] == [ckpt.name]
    assert httpx.get(f"{base}/health").status_code == 200
    r = httpx.post(f"{base}/tokenize", json={"prompt": PROMPTS[0]})
    assert r.json()["tokens"] == ckpt_tokenizer.encode(PROMPTS[0])
    assert r.json()["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{base}/version").json() == {"version": "0.1.0"}


@pytest.fixture(scope="module")
def offline_llm(server):
    from pagefleet.worker import LLM

    return LLM(model=str(server[1]), kv_cache_bytes=16 * 2**20, max_model_len=MAX_MODEL_LEN)


def test_greedy_completions_equal_the_offline_llm(server, openai_client, ckpt_tokenizer, offline_llm):
    from pagefleet.worker import SamplingParams

    r = openai_client.completions.create(model=server[1].name, prompt=PROMPTS, max_tokens=8, temperature=0)
    offline = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in offline]
    assert [c.finish_reason for c in r.choices] == [o.outputs[0].finish_reason for o in offline]
    assert r.usage.prompt_tokens == sum(len(ckpt_tokenizer.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in offline)


def test_max_tokens_reaches_length_with_exact_usage(server, openai_client, ckpt_tokenizer):
    r = openai_client.completions.create(model=server[1].name, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(ckpt_tokenizer.encode(PROMPTS[1]))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_stop_string_ends_the_text(server, openai_client):
    full = openai_client.completions.create(model=server[1].name, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:9]
    r = openai_client.completions.create(model=server[1].name, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop  # which stop ended it, as vLLM reports


def test_chat_streaming_and_not_agree(server, openai_client, ckpt_tokenizer):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi there"}]
    r = openai_client.chat.completions.create(model=server[1].name, messages=messages, max_tokens=6, temperature=0)
    ids = ckpt_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant"
    stream = openai_client.chat.completions.create(model=server[1].name, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [r.choices[0].finish_reason]


def test_completion_stream_text_equals_the_whole_response(server, openai_client):
    whole = openai_client.completions.create(model=server[1].name, prompt=PROMPTS[2], max_tokens=6, temperature=0)
    chunks = list(openai_client.completions.create(model=server[1].name, prompt=PROMPTS[2], max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_n_and_seed(server, openai_client):
    kw = dict(model=server[1].name, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, n=2, seed=1234)
    a, b = openai_client.completions.create(**kw), openai_client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_logprobs(server, openai_client, ckpt_tokenizer, offline_llm):
    from pagefleet.worker import SamplingParams

    r = openai_client.completions.create(model=server[1].name, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    (out,) = offline_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                logprobs=2))
    # one entry per generated token, each the token decoded alone (as OpenAI does; a character
    # split across tokens shows as U+FFFD in both halves)
    assert lp.tokens == [ckpt_tokenizer.decode([t]) for t in out.outputs[0].token_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in out.outputs[0].logprobs], abs=1e-4)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen == max(top.values())  # greedy picks the most likely token
    c = openai_client.chat.completions.create(model=server[1].name, messages=[{"role": "user", "content": "hey"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in content)


def test_bad_requests_never_reach_a_worker(server, openai_client):
    base, ckpt = server
    before = {rid: s.num_requests_total for rid, s in worker_stats().items()}
    long_prompt = list(range(5, 5 + MAX_MODEL_LEN))
    cases = [
        ({"model": ckpt.name, "prompt": long_prompt, "max_tokens": 1}, 400),
        ({"model": "no-such-model", "prompt": "hi"}, 404),
        ({"model": ckpt.name, "prompt": "hi", "echo": True}, 422),
        ({"model": ckpt.name, "prompt": "hi", "max_tokens": "many"}, 400),
        ({"model": ckpt.name, "prompt": ""}, 400),
        ({"model": ckpt.name, "prompt": "hi", "temperature": -0.5}, 400),
    ]
    for body, status in cases:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": 3}]}, timeout=30)
    assert r.status_code == 400
    after = {rid: s.num_requests_total for rid, s in worker_stats().items()}
    assert after == before


def test_requests_spread_over_both_replicas(server, openai_client):
    before = {rid: s.num_requests_total for rid, s in worker_stats().items()}

    def one(i):
        return openai_client.completions.create(model=server[1].name, prompt=f"request {i}", max_tokens=4, temperature=0)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    assert all(r.choices[0].text is not None for r in results)
    after = {rid: s.num_requests_total for rid, s in worker_stats().items()}
    served = {rid: after[rid] - before[rid] for rid in after}
    assert sum(served.values()) == 6
    assert all(n >= 1 for n in served.values()), served


def test_client_disconnect_aborts_and_frees_blocks_within_a_second(server):
    base, ckpt = server
    max_tokens = MAX_MODEL_LEN - 16
    body = {"model": ckpt.name, "prompt": PROMPTS[0], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    generated_before = sum(s.engine.generation_tokens_total for s in worker_stats().values())
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{base}/v1/completions", json=body) as r:
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    events += 1
                if events == 2:
                    break  # leaving the block closes the connection mid-stream
    closed = time.monotonic()
    while True:
        stats = [s.engine for s in worker_stats().values()]
        if all(s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks
               for s in stats):
            break
        assert time.monotonic() - closed < 1.0, list(stats)
        time.sleep(0.05)
    # It was aborted, not run to the end: the engine generated fewer tokens than were asked for.
    generated = sum(s.engine.generation_tokens_total for s in worker_stats().values()) - generated_before
    assert 2 <= generated < max_tokens
