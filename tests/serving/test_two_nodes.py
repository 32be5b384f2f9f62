"""Multi-node, as a Ray user runs it: two `ray start` nodes on this machine with token auth,
pagefleet deployed with `serve deploy deploy/serve.yaml` and with `pagefleet serve --address`,
replicas on both nodes answering, one node's raylet killed while serving goes on, nothing left
running. (Its own cluster, apart from the session's `ray_cluster`.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import free_port
from ray_nodes import BIN, RayNodes

ROOT = Path(__file__).resolve().parents[2]
SIZES = dict(workers=2, worker_num_cpus=1.5, ingress_num_cpus=0.25, kv_cache_bytes="16MiB", max_model_len=256,
             max_num_seqs=8)


@pytest.fixture
def nodes():
    cluster = RayNodes()
    try:
        cluster.start_head(num_cpus=2)  # with the ingress (0.25 CPU) only one 1.5-CPU replica fits per node
        cluster.add_node(num_cpus=2)
        yield cluster
    finally:
        left = cluster.stop()
    assert not left, f"processes left running: {sorted(left)}"


def _wait_ready(base: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{base} not healthy"
        time.sleep(1)


def _complete(base: str, model: str, i: int, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=timeout,
                      json={"model": model, "prompt": f"node test {i}", "max_tokens": 4, "temperature": 0})


def _tokens_by_replica(nodes: RayNodes) -> list[dict[str, float]]:
    """Per node (head first): replica -> generated tokens, read from that node's metrics agent."""
    out = []
    for port in nodes.metrics_ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        found: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("ray_pagefleet_generation_tokens_total{"):
                replica = re.search(r'replica="([^"]+)"', line).group(1)
                found[replica] = found.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        out.append(found)
    return out


def _both_nodes_answer(nodes: RayNodes, base: str, model: str, before: list[dict[str, float]],
                       timeout_s: float = 120) -> None:
    """Send batches of 8 concurrent requests until each node's agent shows one replica of this app
    (not in ``before``) that generated tokens: replicas on both nodes answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        with ThreadPoolExecutor(8) as pool:
            assert [r.status_code for r in pool.map(lambda i: _complete(base, model, i), range(8))] == [200] * 8
        time.sleep(3)  # the engines flush each second, the agents export each second here
        per_node = [{r: n for r, n in now.items() if r not in old and n > 0}
                    for now, old in zip(_tokens_by_replica(nodes), before)]
        if all(len(replicas) == 1 for replicas in per_node):
            return
        assert time.monotonic() < deadline, f"replicas with output per node: {per_node}"


def test_two_nodes_serve_deploy_pagefleet_serve_and_a_lost_node(nodes, tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("llama")
    model = ckpt.name
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"].update(model=str(ckpt), **SIZES)
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{port}"

    # 1. The shipped Serve config, deployed to the running cluster as a Ray user does.
    done = subprocess.run([str(BIN / "serve"), "deploy", "--address", nodes.dashboard, str(tmp_path / "serve.yaml")],
                          env=nodes.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    _wait_ready(base)
    _both_nodes_answer(nodes, base, model, [{}, {}])
    first_app = _tokens_by_replica(nodes)
    done = subprocess.run([str(BIN / "serve"), "shutdown", "-y", "--address", nodes.dashboard], env=nodes.env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

    # 2. Without the cluster's token: one sentence, no traceback.
    no_auth = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    no_auth["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    done = subprocess.run([str(BIN / "pagefleet"), "serve", "--address", nodes.address, "--model", str(ckpt)],
                          env=no_auth, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("pagefleet serve: error:")]
    assert "RAY_AUTH_MODE=token" in error and "~/.ray/auth_token" in error and "RAY_AUTH_TOKEN" in error

    # 3. pagefleet serve --address: the same app from the CLI, joined to the cluster.
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(BIN / "pagefleet"), "serve", "--address", nodes.address, "--model", str(ckpt),
                             "--port", str(port), "--workers", "2", "--worker-cpus", "1.5", "--kv-cache-bytes", "16MiB",
                             "--max-model-len", "256", "--max-num-seqs", "8"],
                            env=nodes.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any("ready in" in line for line in output):
            assert proc.poll() is None, "".join(output)[-3000:]
            assert time.monotonic() < deadline, "".join(output)[-3000:]
            time.sleep(1)
        banner = "".join(output)
        assert f"http://127.0.0.1:{port}/v1" in banner
        for metrics_port in nodes.metrics_ports:  # where Prometheus scrapes each node
            assert f":{metrics_port}" in banner
        _both_nodes_answer(nodes, base, model, first_app)

        # 4. The second node's raylet dies (its replica with it); the head's replica serves on.
        os.kill(nodes.raylet_pid(1), signal.SIGKILL)
        deadline = time.monotonic() + 120
        streak = 0
        while streak < 5:
            assert time.monotonic() < deadline, "serving did not continue after the node was lost"
            try:
                streak = streak + 1 if _complete(base, model, streak, timeout=30).status_code == 200 else 0
            except httpx.HTTPError:
                streak = 0
        # 5. Ctrl-C: the app and the Serve instance this command started are gone, port released.
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, "".join(output)[-3000:]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
