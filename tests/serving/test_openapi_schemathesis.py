"""schemathesis against the server's own OpenAPI schema: 0 5xx, 0 failures.

The real app (API key set) under a real HTTP server (uvicorn) on a free loopback port, with the
scripted worker the other router tests use; schemathesis' command line, run over every operation
of ``/openapi.json`` with all its default checks (server errors, status codes, content types,
headers, response schemas, positive and negative data, auth, methods), except that
``positive_data_acceptance`` is the variant in ``schemathesis_checks.py`` that knows the
cross-field rules JSON Schema cannot state. The server's own count of status codes backs the
"0 5xx" independently of schemathesis.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn

from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.preprocess import ModelInfo, ServingLimits, longest_token_chars
from pagefleet.router.openai.service import OpenAIService
from pagefleet.worker.request_check import RequestLimits

from serving_fakes import MAX_MODEL_LEN, MODEL, FakeWorkerClient

API_KEY = "schemathesis-test-key"
MAX_EXAMPLES = 30  # per operation and phase; the whole run takes about 15 s on 2 busy cores
SEED = 20261130
OPERATIONS = {"GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses",
              "POST /tokenize",
              "POST /detokenize", "GET /health", "GET /version", "GET /metrics"}


class StatusCount:
    """ASGI wrapper that counts the status of every response the app sends."""

    def __init__(self, app) -> None:
        self.app = app
        self.statuses: collections.Counter[int] = collections.Counter()

    async def __call__(self, scope, receive, send) -> None:
        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.statuses[message["status"]] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


@pytest.fixture(scope="module")
def served(tokenizer):
    """(base URL, status counter) of the app under uvicorn on 127.0.0.1."""
    info = ModelInfo(served_model_name=MODEL,
                     limits=RequestLimits(vocab_size=len(tokenizer), max_model_len=MAX_MODEL_LEN, max_num_seqs=8),
                     serving=ServingLimits(max_prompt_chars=MAX_MODEL_LEN * longest_token_chars(tokenizer)))
    service = OpenAIService(tokenizer=tokenizer, info=info, client=FakeWorkerClient(tokenizer, len(tokenizer)))
    counted = StatusCount(build_openai_app(service, api_key=API_KEY))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(counted, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", counted.statuses
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_schemathesis_finds_no_server_error_and_no_schema_violation(served, tmp_path):
    url, statuses = served
    report_path = tmp_path / "schemathesis.json"
    here = Path(__file__).parent
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_checks",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
           "--header", f"Authorization: Bearer {API_KEY}",
           "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--generation-deterministic",
           "--workers", "1", "--exclude-checks", "positive_data_acceptance",
           "--report", "json", "--report-json-path", str(report_path),
           "--output-sanitize", "false", "--no-color"]
    started = time.monotonic()
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert report_path.exists(), run.stdout[-6000:] + run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert report["failures"] == [] and report["errors"] == [], run.stdout[-6000:]
    assert report["operations"]["tested"] == len(OPERATIONS) == report["operations"]["total"]
    # Every operation got requests that its schema allows and the server accepted.
    accepted = {op: sum(phase["accepted"] for phase in rates.values()) for op, rates in report["valid_rates"].items()}
    assert {op for op, n in accepted.items() if n > 0} == OPERATIONS, accepted
    assert not [s for s in statuses if s >= 500], statuses
    # Both sides were exercised: requests served, requests refused, and the key was checked.
    assert statuses[200] > 0 and statuses[400] > 0 and statuses[401] > 0, statuses
    print(json.dumps({"schemathesis": report["schemathesis_version"], "operations": report["operations"]["tested"],
                      "accepted_valid": accepted,
                      "test_cases": report["test_cases"]["generated"], "failures": len(report["failures"]),
                      "server_statuses": dict(sorted(statuses.items())), "seconds": round(elapsed, 1)}))
