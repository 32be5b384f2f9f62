"""One request check: the ingress and `LLM.generate` refuse the same request with the same message,
and the ingress gets there without loading any engine module."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from pagefleet.router.ingress import load_model_info
from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.service import OpenAIService
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.sampling_params import SamplingParams

from serving_fakes import FakeWorkerClient

MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4
VOCAB = 1000  # the tiny demo checkpoint's


@pytest.fixture(scope="module")
def args(tiny_checkpoint):
    return EngineArgs(model=str(tiny_checkpoint("llama")), max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                      kv_cache_bytes=16 << 20, dtype="float32")


@pytest.fixture(scope="module")
def ingress(args):
    tokenizer, info = load_model_info(args)
    service = OpenAIService(tokenizer=tokenizer, info=info, client=FakeWorkerClient(tokenizer, VOCAB))
    with TestClient(build_openai_app(service)) as client:
        yield client


@pytest.fixture(scope="module")
def llm(args):
    from pagefleet.worker import LLM

    with LLM(**{f: getattr(args, f) for f in ("model", "max_model_len", "max_num_seqs", "kv_cache_bytes",
                                               "dtype")}) as engine:
        yield engine


# (prompt token ids, sampling fields sent both as JSON and as SamplingParams, the param named)
BAD = [
    ([5, VOCAB], {"max_tokens": 4}, "prompt"),
    ([5] * MAX_MODEL_LEN, {"max_tokens": 1}, "prompt"),
    ([5] * 60, {"max_tokens": 5}, "max_tokens"),
    ([5, 6], {"max_tokens": 4, "n": MAX_NUM_SEQS + 1}, "n"),
    ([5, 6], {"max_tokens": 4, "stop_token_ids": [VOCAB + 7]}, "stop_token_ids"),
    ([5] * 60, {"max_tokens": None, "min_tokens": 10}, "min_tokens"),
    ([5, 6], {"max_tokens": 4, "top_p": 0.0}, "top_p"),
    ([5, 6], {"max_tokens": 4, "seed": 2**64}, "seed"),
    ([5, 6], {"max_tokens": 0}, "max_tokens"),
    # What the one engine thread would scan after every token is bounded (engine options).
    ([5, 6], {"max_tokens": 4, "stop": [f"s{i}" for i in range(33)]}, "stop"),
    ([5, 6], {"max_tokens": 4, "stop": ["x" * 513]}, "stop"),
    ([5, 6], {"max_tokens": 4, "stop_token_ids": list(range(129))}, "stop_token_ids"),
]


@pytest.mark.parametrize("prompt, fields, param", BAD)
def test_same_bad_request_same_message(ingress, llm, prompt, fields, param):
    r = ingress.post("/v1/completions", json={"prompt": prompt, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    with pytest.raises(ValueError) as offline:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(**fields))
    assert str(offline.value) == error["message"]
    assert not llm.engine.has_unfinished()



@pytest.mark.parametrize("priority, message", [
    (3, "priority 3 needs a server started with --scheduling-policy priority; this one schedules fcfs "
        "(only priority 0)"),
    (2**63, "priority must be an integer that fits in a signed 64-bit integer, got 9223372036854775808"),
])
def test_a_priority_the_fcfs_engine_cannot_honour_is_refused_alike(ingress, llm, priority, message):
    """vLLM documents a priority other than 0 as an error without priority scheduling."""
    for route, body in (("/v1/completions", {"prompt": [5, 6]}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = ingress.post(route, json={**body, "max_tokens": 2, "priority": priority})
        assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == (400, "priority", message)
    r = ingress.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, headers={"X-Vllm-Priority": "3"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "priority")  # vLLM's header counts as the field
    with pytest.raises(ValueError) as offline:
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), priority=priority)
    assert str(offline.value) == message
    with pytest.raises(ValueError, match="^1 priorities for 2 prompts$"):  # one for all, or one a prompt
        llm.generate([{"prompt_token_ids": [5, 6]}] * 2, SamplingParams(max_tokens=2), priority=[0])
    assert not llm.engine.has_unfinished()
    r = ingress.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "priority": 0},
                     headers={"X-Vllm-Priority": "not a number"})  # ignored, as vLLM ignores it
    assert r.status_code == 200, r.text

def test_importing_and_starting_the_ingress_loads_no_engine_module(args):
    code = f"""
import json, sys
from fastapi.testclient import TestClient
from pagefleet.router.ingress import load_model_info, OpenAIIngress
from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.service import OpenAIService
from pagefleet.worker.engine_args import EngineArgs
args = EngineArgs(model={args.model!r}, max_model_len={MAX_MODEL_LEN})
tokenizer, info = load_model_info(args)
app = build_openai_app(OpenAIService(tokenizer=tokenizer, info=info, client=None))
with TestClient(app) as client:
    r = client.post("/tokenize", json={{"prompt": "hello"}})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={{"prompt": [5, 99999]}})
    assert r.status_code == 400, r.text
print(json.dumps(sorted(m for m in sys.modules if m.startswith("pagefleet"))))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    # kernels.cpu.build is the C++ build helper (ctypes, no torch) the scheduler's compiled KV index uses too
    build = ("pagefleet.kernels", "pagefleet.kernels.cpu", "pagefleet.kernels.cpu.build")
    engine_modules = [m for m in loaded if m.startswith("pagefleet.kernels") and m not in build or m in (
        "pagefleet.worker.engine.llm_engine", "pagefleet.worker.model_executor.model", "pagefleet.worker.model_executor.layers",
        "pagefleet.worker.model_executor.model_runner", "pagefleet.worker.model_executor.loader", "pagefleet.worker.engine.async_engine")]
    assert engine_modules == []
    assert "pagefleet.router.ingress" in loaded and "pagefleet.worker.request_check" in loaded
