"""SIGTERM to a real ``pagefleet serve`` (its own local Ray cluster, two ingress replicas, the tiny
demo checkpoint) under 8 streams: every stream finishes, a request sent during the drain is
refused with 503, and the process exits 0 by itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cluster_helpers import StreamedCompletion
from conftest import free_port

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
STREAMS = 8
MAX_TOKENS = 1800  # each stream runs for seconds, so most are still running when every one has started
DRAIN_TIMEOUT_S = 120
CLIENT_LAG_S = 2.0  # how late this process may read a stream's end (see the drain count below)


def _stop(proc: subprocess.Popen) -> None:
    """A run that failed: SIGINT twice (stop at once, Serve and Ray shut down), then kill."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(1)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def test_sigterm_drains_every_ingress_replica_then_exits_0(tiny_checkpoint, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster, not this session's
    log = tmp_path / "serve.log"
    cmd = [PAGEFLEET, "serve", str(tiny_checkpoint("llama")), "--port", str(port),
           "--metrics-export-port", str(free_port()), "--ingress-replicas", "2", "--worker-cpus", "0.5",
           "--kv-cache-bytes", "32MiB", "--max-model-len", "2048", "--max-num-seqs", str(STREAMS),
           "--drain-timeout-s", str(DRAIN_TIMEOUT_S)]
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        for i in range(4):  # both ingress replicas (HAProxy takes turns) open their channel to the worker
            warm = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": f"warm {i}", "max_tokens": 4},
                              timeout=120)
            assert warm.status_code == 200, warm.text
        streams = [StreamedCompletion(f"{base}/v1/completions", {
            "model": model, "prompt": f"story {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) for i in range(STREAMS)]
        for s in streams:
            s.start()
        # SIGTERM once every stream has its first token (a request not yet at the ingress would be
        # refused). On a busy machine the first ones may have ended by then: the drain must find
        # the rest in flight, and all 8 must end whole either way.
        for s in streams:
            assert s.started.wait(120) and s.data, s.outcome()
        running = sum(not s.done for s in streams)
        assert running >= 1
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while "pagefleet: draining " not in log.read_text():  # every ingress replica has stopped admitting
            assert time.monotonic() - signalled < 60, log.read_text()[-3000:]
            time.sleep(0.05)
        drain_seen = time.monotonic()
        refused = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "late", "max_tokens": 2},
                             timeout=30)
        health = httpx.get(f"{base}/health", timeout=30).status_code
        for s in streams:
            s.join(120)
        rc = proc.wait(DRAIN_TIMEOUT_S + 60)  # by itself: the drain, then Serve and Ray shut down
        exited_after_s = time.monotonic() - signalled
    except BaseException:
        _stop(proc)
        print(log.read_text()[-5000:])
        raise

    text = log.read_text()
    assert [s.outcome() for s in streams] == [(200, True, [], MAX_TOKENS, None)] * STREAMS, text[-3000:]
    assert (refused.status_code, refused.json()["error"]["code"], refused.headers["Retry-After"]) == \
        (503, "draining", "5")
    assert health == 503
    assert rc == 0, text[-3000:]
    assert "pagefleet: SIGTERM: draining (a second Ctrl-C or SIGTERM stops at once)" in text
    drained = int(re.search(r"pagefleet: draining (\d+) requests, up to " + str(DRAIN_TIMEOUT_S) + " s", text).group(1))
    # The replicas counted their requests in flight before that line was written: a stream whose
    # end reached this process well after the line was seen was one of them, and none had started
    # after SIGTERM. "Well after": a loaded machine's client threads read a stream's last bytes
    # late, after a server that had already ended it reported none in flight.
    ended_later = sum(s.ended_at > drain_seen + CLIENT_LAG_S for s in streams)
    assert ended_later <= drained <= running, (ended_later, drained, running, text[-3000:])
    assert "pagefleet: drained in " in text and "requests cut" not in text
    print(f"exited {exited_after_s:.1f} s after SIGTERM")
