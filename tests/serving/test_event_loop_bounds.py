"""Nothing that grows with a request runs on the ingress's event loop (security round 3, A3 and A4):
big tools are measured before the template renders them, and rendered on a thread when allowed;
a non-streamed response is bounded before it runs and built and encoded on a thread. Meanwhile
``GET /version`` on the same server answers within 250 ms.

The server is the real app under uvicorn in a process of its own (``bounds_server.py``), so the
probe's timings are its event loop's, not this process's."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from bounds_server import make_tools_tokenizer

SERVER = Path(__file__).with_name("bounds_server.py")
MAX_MODEL_LEN = 2048
MAX_PROMPT_CHARS = 1_000_000
MAX_RESPONSE_TOKENS = 300_000
VERSION_WITHIN_S = 0.25


@pytest.fixture(scope="module")
def base():
    proc = subprocess.Popen([sys.executable, str(SERVER), "--max-model-len", str(MAX_MODEL_LEN),
                             "--max-prompt-chars", str(MAX_PROMPT_CHARS),
                             "--max-unstreamed-response-tokens", str(MAX_RESPONSE_TOKENS)],
                            stdout=subprocess.PIPE, text=True, cwd=SERVER.parent)
    try:
        line = ""
        while not line.startswith("PORT "):  # the tokenizer's trainer prints first
            line = proc.stdout.readline()
            assert line, "the server exited"
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/version", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


class VersionProbe:
    """Asks ``GET /version`` every 20 ms from a thread of its own while the block runs; ``worst``
    is the longest answer, ``count`` how many came."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                assert client.get(f"{self.base}/version").status_code == 200
                self.latencies.append(time.monotonic() - started)
                self._stop.wait(0.02)

    def __enter__(self) -> "VersionProbe":
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def worst(self) -> float:
        return max(self.latencies)


def _tools(count: int, params: int, description_chars: int = 240) -> list[dict]:
    properties = {f"p{i}": {"type": "string", "description": f"{i} " + "d" * description_chars}
                  for i in range(params)}
    return [{"type": "function", "function": {"name": f"tool_{j}", "description": "a tool",
                                              "parameters": {"type": "object", "properties": properties}}}
            for j in range(count)]


MESSAGES = [{"role": "user", "content": "hi"}]
BIG_TOOLS = _tools(128, 100)  # about 3.5 MiB of JSON: more than MAX_PROMPT_CHARS
SOME_TOOLS = _tools(16, 50)  # about 200 KB: under MAX_PROMPT_CHARS, far over MAX_MODEL_LEN tokens


def _error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_tools_over_the_prompt_bound_are_refused_before_rendering_while_version_answers(base, route):
    body = {"messages": MESSAGES, "tools": BIG_TOOLS, **({"max_tokens": 4} if route != "/tokenize" else {})}
    with VersionProbe(base) as probe:
        started = time.monotonic()
        r = httpx.post(f"{base}{route}", json=body, timeout=120)
        took = time.monotonic() - started
        time.sleep(0.2)
    message = _error(r, "tools")
    # counted from the tools themselves, before the template or the tokenizer saw them
    assert "with its tools" in message and f"at most {MAX_PROMPT_CHARS} before tokenizing" in message
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert took < 2.0, took
    assert probe.worst < VERSION_WITHIN_S, (probe.worst, len(probe.latencies))


def test_tools_under_the_prompt_bound_are_rendered_off_the_loop(base):
    tokenizer = make_tools_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, tools=SOME_TOOLS, tokenize=False, add_generation_prompt=True)
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    assert expected > MAX_MODEL_LEN
    with VersionProbe(base) as probe:
        chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "tools": SOME_TOOLS,
                                                                "max_tokens": 4}, timeout=120)
        tokenized = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, "tools": SOME_TOOLS}, timeout=120)
    # rendered and tokenized in full: the engine's own length check refuses it, counting every token
    message = _error(chat, "prompt")
    assert f"your prompt has {expected} tokens" in message
    assert tokenized.status_code == 200 and tokenized.json()["count"] == expected
    assert len(probe.latencies) >= 5
    assert probe.worst < VERSION_WITHIN_S, (probe.worst, len(probe.latencies))


def test_a_non_streamed_response_over_the_bound_is_refused_before_it_runs(base):
    body = {"messages": MESSAGES, "n": 16, "max_completion_tokens": 1024, "logprobs": True, "top_logprobs": 20}
    started = time.monotonic()
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    took = time.monotonic() - started
    message = _error(r, "max_completion_tokens")
    assert "n=16 x max_completion_tokens=1024 x (1 + top_logprobs=20)" in message
    assert f"holds up to {16 * 1024 * 21} tokens" in message and "max_unstreamed_response_tokens" in message
    assert f"at most {MAX_RESPONSE_TOKENS}" in message
    assert took < 1.0, took
    # the same request streamed is not one body: it runs
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True, "n": 1,
                                                                    "max_completion_tokens": 64}) as s:
        assert s.status_code == 200
        assert [line for line in s.iter_lines() if line][-1] == "data: [DONE]"


def test_a_non_streamed_response_under_the_bound_is_built_off_the_loop(base):
    n, max_tokens, top = 16, 1024, 17
    assert n * max_tokens * (1 + top) <= MAX_RESPONSE_TOKENS
    body = {"messages": MESSAGES, "n": n, "max_completion_tokens": max_tokens, "logprobs": True, "top_logprobs": top}
    with VersionProbe(base) as probe:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        time.sleep(0.1)
    assert r.status_code == 200, r.text[:500]
    out = r.json()
    assert out["usage"]["completion_tokens"] == n * max_tokens
    assert [c["index"] for c in out["choices"]] == list(range(n))
    for choice in out["choices"]:
        content = choice["logprobs"]["content"]
        assert choice["finish_reason"] == "length" and len(content) == max_tokens
        assert [len(entry["top_logprobs"]) for entry in content] == [top] * max_tokens
    assert len(probe.latencies) >= 5  # it took a while to build
    assert probe.worst < VERSION_WITHIN_S, (probe.worst, len(probe.latencies))
