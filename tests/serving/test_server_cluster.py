"""The whole server on a real local Ray cluster: deploy/serve.yaml brought up with `serve run`,
two worker replicas, driven with the real `openai` client and raw HTTP.

The app comes up once for this module (about a minute on two cores) and every test below runs
against it; then the `pagefleet bench` runs, and last the two that check KV-aware routing on it:
0 drift of the global scheduler's view after 1,000 requests with client aborts, and serving on
while the scheduler is killed.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from cluster_app import MAX_MODEL_LEN, assert_views_equal_pools, ingress, start_app, traffic, wait_idle, worker_stats

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
PROMPTS = ["Hello, my name is", "The capital of France is", "pagefleet serves models"]
NUM_REQUESTS = 1000


@pytest.fixture(scope="module")
def server(ray_cluster, serve_http_port, tiny_checkpoint, tmp_path_factory):
    """(base URL, checkpoint path); the global scheduler starts fresh with the app."""
    from ray import serve

    from pagefleet.router.global_scheduler.actor import stop_scheduler

    from cluster_app import APP

    stop_scheduler()
    ckpt = tiny_checkpoint("llama")
    yield start_app(ray_cluster, serve_http_port, ckpt, tmp_path_factory.mktemp("serve")), ckpt
    serve.delete(APP)
    stop_scheduler()


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
    # served under the --model argument as given too, as vLLM serves it (vllm bench serve --model DIR)
    r = openai_client.completions.create(model=str(ckpt), prompt=PROMPTS[0], max_tokens=2,
                                         extra_body={"ignore_eos": True})
    assert (r.model, r.usage.completion_tokens) == (ckpt.name, 2)
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
        ({"model": ckpt.name, "prompt": "hi", "suffix": "x"}, 400),
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


def run_bench(base: str, *flags: str) -> subprocess.CompletedProcess:
    done = subprocess.run([PAGEFLEET, "bench", "--base-url", base, "--disable-tqdm", *flags],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# ---- pagefleet bench, the installed command, against this app -------------------------------


def test_bench_random_completions_writes_report_json_and_png(server, tmp_path):
    base, ckpt = server
    result, png = tmp_path / "result.json", tmp_path / "plot.png"
    done = run_bench(base, "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "6",
                     "--max-concurrency", "3", "--save-result", str(result), "--save-detailed", "--plot", str(png),
                     "--tokenizer", str(ckpt))
    out = done.stdout
    assert "Successful requests:                     6" in out
    assert "Failed requests:                         0" in out
    assert "Maximum request concurrency:             3" in out
    for header in ("Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                   "End-to-end Latency"):
        assert header in out
    saved = json.loads(result.read_text())
    assert (saved["model_id"], saved["tokenizer_id"]) == (ckpt.name, str(ckpt))  # the model from /v1/models
    assert (saved["completed"], saved["failed"], saved["max_concurrency"]) == (6, 0, 3)
    # the random dataset ignores EOS: every request generates its 6 tokens; the server counts
    # each prompt as the 24 tokens the dataset built
    assert saved["output_lens"] == [6] * 6 and saved["total_output_tokens"] == 36
    assert saved["input_lens"] == [24] * 6 and saved["total_input_tokens"] == 144
    # at most one chunk per token after the first (fewer when a stream lags the engine)
    assert all(1 <= len(itl) <= 5 for itl in saved["itls"])
    assert 0 < saved["median_ttft_ms"] < saved["median_e2el_ms"]
    assert saved["max_concurrent_requests"] == 3  # the first three start together and overlap
    assert png_size(png) == (1430, 550)  # 13 x 5 inches at 110 dpi


def test_bench_shared_prefix_chat_sees_prefix_cache_hits(server, tmp_path):
    base, ckpt = server
    result = tmp_path / "result.json"
    done = run_bench(base, "--endpoint", "/v1/chat/completions", "--dataset", "shared-prefix",
                     "--shared-prefix-num-tenants", "2", "--shared-prefix-questions-per-tenant", "3",
                     "--shared-prefix-len", "64", "--shared-prefix-question-len", "8",
                     "--shared-prefix-output-len", "4", "--max-concurrency", "1", "--ignore-eos",
                     "--save-result", str(result), "--tokenizer", str(ckpt))
    saved = json.loads(result.read_text())
    assert (saved["completed"], saved["failed"], saved["total_output_tokens"]) == (6, 0, 24)
    # One request at a time over two replicas: of each tenant's three requests, two met on one
    # replica, and the later found at least the prefix's first 48 tokens (3 full blocks of the
    # 64, less a token that may merge with the question) in its prefix cache.
    assert saved["total_cached_tokens"] >= 2 * 48
    assert saved["cached_token_share"] == saved["total_cached_tokens"] / saved["total_input_tokens"]
    assert f"Cached prompt tokens (share):            {saved['total_cached_tokens']} (" in done.stdout


# ---- KV-aware routing on this app (last: the second one restarts the global scheduler) ----------


def test_zero_drift_after_a_thousand_requests_with_aborts(server):
    import ray

    from pagefleet.router.global_scheduler.actor import get_scheduler

    base, model, scheduler = server[0], server[1].name, get_scheduler()
    before = ingress().routing_counters.remote().result()
    decided_before, fallbacks_before = sum(before.decisions.values()), before.fallbacks
    channels_before = ingress().channel_counters.remote().result()
    statuses = asyncio.run(traffic(base, model, NUM_REQUESTS, seed=0))
    assert statuses == [200] * NUM_REQUESTS
    wait_idle()
    # their output came on the ingress's channel connections (a request that starts while its
    # replica's channel is not attached streams on its own call), never on a Serve-stream channel
    channels = ingress().channel_counters.remote().result()
    assert channels.deltas - channels_before.deltas >= 0.9 * NUM_REQUESTS
    assert channels.channels_opened == channels.socket_channels >= 1
    # and nearly all were sent on those connections rather than through a Serve handle call (the
    # first to a replica opens its channel through Serve; one the replica refused went through Serve)
    on_connections = (channels.sent - channels_before.sent) - (channels.refused - channels_before.refused)
    assert on_connections >= 0.9 * NUM_REQUESTS
    views = assert_views_equal_pools(scheduler)
    counters = ray.get(scheduler.counters.remote())
    # the stream alone was exact: no batch lost, no snapshot needed to repair a view
    assert (counters.gaps, counters.snapshots_applied) == (0, 0)
    total_blocks = sum(v.num_total_blocks for v in views.values())
    assert counters.block_events > 2 * total_blocks  # the pools were churned through, evictions included
    assert all(v.routing_keys for v in views.values())  # and both workers hold cached prefixes now
    routing = ingress().routing_counters.remote().result()
    assert sum(routing.decisions.values()) - decided_before + routing.fallbacks - fallbacks_before == NUM_REQUESTS
    # some went where their prefix was cached, and the workers did find it there
    assert routing.decisions["prefix"] > 0 and routing.realised_hit_blocks > 0


def test_killing_the_scheduler_mid_traffic_keeps_serving_and_the_restart_rebuilds_from_snapshots(server):
    import ray

    from pagefleet.router.global_scheduler.actor import get_scheduler

    base, model, scheduler = server[0], server[1].name, get_scheduler()
    before = ingress().routing_counters.remote().result()
    decided_before = sum(before.decisions.values()) + before.fallbacks
    mirror_before = ingress().mirror_counters.remote().result()
    first_start = ray.get(scheduler.start_time.remote())

    async def run():
        done: list[int] = []
        task = asyncio.create_task(traffic(base, model, 300, seed=1, concurrency=6, statuses=done))
        while len(done) < 50:
            await asyncio.sleep(0.01)
        ray.kill(scheduler, no_restart=False)  # Ray restarts it (max_restarts=-1), empty
        killed_at = len(done)
        statuses = await task
        return killed_at, statuses

    killed_at, statuses = asyncio.run(run())
    assert killed_at < 100  # mid-traffic: most requests came after the kill
    assert statuses == [200] * 300  # nothing failed while the scheduler was gone
    routing = ingress().routing_counters.remote().result()
    # every request was routed: by the ingress's copy of the view while it was current, by load
    # (a counted fallback) while it was stale
    assert sum(routing.decisions.values()) + routing.fallbacks == decided_before + 300
    mirror = ingress().mirror_counters.remote().result()
    assert mirror.failed_polls > mirror_before.failed_polls  # the copy saw the actor go
    # and takes the new incarnation's whole view once it answers (the traffic may end first)
    deadline = time.monotonic() + 30
    while mirror.resyncs == mirror_before.resyncs and time.monotonic() < deadline:
        time.sleep(0.2)
        mirror = ingress().mirror_counters.remote().result()
    assert mirror.resyncs > mirror_before.resyncs
    wait_idle()
    assert ray.get(scheduler.start_time.remote()) > first_start  # the same handle reaches the new incarnation
    views = assert_views_equal_pools(scheduler)
    counters = ray.get(scheduler.counters.remote())
    assert counters.snapshots_applied >= len(views) == 2  # every worker's view came back from a snapshot
