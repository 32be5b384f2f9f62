"""``pagefleet bench`` against a minimal OpenAI-compatible server with scripted timing and
scripted failures (tests/serving/scripted_openai_server.py, a subprocess on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagefleet.cluster.cli import main

SERVER = Path(__file__).with_name("scripted_openai_server.py")
@pytest.fixture
def scripted_server(tmp_path, tokenizer_dir):
    """Factory: start a scripted server with extra flags; returns (base URL, its log path)."""
    procs = []

    def start(*flags: str) -> tuple[str, Path]:
        log = tmp_path / f"server{len(procs)}.jsonl"
        proc = subprocess.Popen([sys.executable, str(SERVER), "--port", "0", "--log", str(log),
                                 "--model", str(tokenizer_dir), *flags], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        return f"http://127.0.0.1:{int(line.split()[1])}", log

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


def bench(capsys, base: str, result: Path, *flags: str) -> tuple[int, str, dict]:
    code = main(["bench", "--base-url", base, "--disable-tqdm", "--save-result", str(result), "--save-detailed",
                 *flags])
    out = capsys.readouterr().out
    return code, out, json.loads(result.read_text())


def truth(log: Path, saved: dict) -> dict[str, list[float]]:
    """What the server actually did, per request, in ms: TTFT and E2EL from the client's send
    (its start time, same monotonic clock) to the server's first and last token write; the
    gaps between writes; TPOT over the writes after the first."""
    sent = {}
    for line in log.read_text().splitlines():
        row = json.loads(line)
        sent[int(row["request_id"].rsplit("-", 1)[1])] = row["sent"]
    out = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    for i, start in enumerate(saved["start_times"]):
        times = sent[i]
        out["ttft"].append((times[0] - start) * 1e3)
        out["e2el"].append((times[-1] - start) * 1e3)
        out["tpot"].append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
        out["itl"].extend((b - a) * 1e3 for a, b in zip(times, times[1:]))
    return out


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_reported_latencies_are_within_5ms_of_what_the_server_did(scripted_server, capsys, tmp_path, endpoint):
    base, log = scripted_server("--ttft-ms", "200", "--itl-ms", "20")
    # Poisson arrivals stagger the streams, so one stall of this process on a busy machine
    # delays one request's chunk, not every stream's at once.
    code, out, saved = bench(capsys, base, tmp_path / "r.json", "--endpoint", endpoint, "--num-prompts", "16",
                             "--request-rate", "25", "--max-concurrency", "8", "--random-input-len", "16",
                             "--random-output-len", "10", "--percentiles", "50,90")
    assert code == 0
    assert "Successful requests:                     16" in out
    assert (saved["completed"], saved["failed"], saved["total_output_tokens"]) == (16, 0, 160)
    assert saved["total_cached_tokens"] == 16 * 3  # the server's usage.prompt_tokens_details, summed
    # The client's own CPU over the run: some, less than the run's wall time (one busy thread at
    # most: the scripted server's waits are most of it), and the report gives it per token.
    assert 0 < saved["client_cpu_s"] < saved["duration"]
    assert f"Client CPU per output token (ms):        {1000 * saved['client_cpu_s'] / 160:.3f}" in out
    actual = truth(log, saved)
    assert len(actual["itl"]) == 16 * 9 and len(saved["itls"]) == 16 and all(len(x) == 9 for x in saved["itls"])
    # The server never ran ahead of its script (first token 200 ms after the request arrived,
    # the tenth 9 x 20 ms later); on a busy machine it can only be late, and the truth is
    # what it actually did, not the script.
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    for row in rows:
        assert row["sent"][0] - row["arrived"] >= 0.200 and row["sent"][-1] - row["arrived"] >= 0.380
    # A machine that cannot keep a trivial event loop's timers within 5 ms cannot time anything
    # to 5 ms: the client shares it. Then the check is not made, and the skip says why.
    late_ms = statistics.median((row["sent"][0] - row["arrived"] - 0.200) * 1e3 for row in rows)
    if late_ms > 5:
        pytest.skip(f"machine too loaded for a 5 ms check: the scripted server's own first tokens were a "
                    f"median {late_ms:.1f} ms late (load average {os.getloadavg()[0]:.0f})")
    # The client's figures match what the server did, within 5 ms: the medians of TTFT, TPOT and
    # ITL, and the means of TPOT and ITL (averages over 144 gaps). Not the TTFT mean: one stall
    # of this process on an overloaded machine lands whole in one request's TTFT, and only 16
    # share it (seen with two busy loops on two cores: medians within 0.6 ms, the TTFT mean
    # 13 ms late while the server itself ran 200 ms behind its script).
    for name in ("ttft", "tpot", "itl"):
        assert saved[f"median_{name}_ms"] == pytest.approx(statistics.median(actual[name]), abs=5), name
    for name in ("tpot", "itl"):
        assert saved[f"mean_{name}_ms"] == pytest.approx(statistics.fmean(actual[name]), abs=5), name
    # E2EL is the first token's time plus every gap after it, request by request.
    e2els = [ttft + sum(itl) for ttft, itl in zip(saved["ttfts"], saved["itls"])]
    assert saved["mean_e2el_ms"] == pytest.approx(statistics.fmean(e2els) * 1e3, rel=1e-9)


def test_server_errors_mid_run_are_failed_requests(scripted_server, capsys, tmp_path):
    # request 2 gets HTTP 500; request 5's stream breaks off after two tokens
    base, _ = scripted_server("--ttft-ms", "20", "--itl-ms", "5", "--http-error-on", "2", "--cut-on", "5")
    code, out, saved = bench(capsys, base, tmp_path / "r.json", "--num-prompts", "8", "--max-concurrency", "1",
                             "--random-input-len", "8", "--random-output-len", "6")
    assert code == 0
    assert (saved["completed"], saved["failed"], saved["total_output_tokens"]) == (6, 2, 36)
    assert "Successful requests:                     6" in out
    assert "Failed requests:                         2" in out
    errors = [e for e in saved["errors"] if e]
    assert len(errors) == 2
    assert errors[0].startswith("HTTP 500: ") and "scripted failure" in errors[0]
    assert errors[1].startswith("ClientPayloadError")
    assert f"Error 0: {errors[0]}" in out and f"Error 1: {errors[1]}" in out
    assert saved["output_lens"][2] == 0 and saved["output_lens"][5] == 0


def test_a_server_closing_idle_connections_loses_no_request(scripted_server, capsys, tmp_path, monkeypatch):
    """The model is looked up before the prompts are built, which takes seconds with a real
    tokenizer (blocking the event loop); a server that closes idle kept-alive connections
    meanwhile (uvicorn, under `vllm serve`, after 5 s) must not cost the run's first request
    ("Can not write request body" on the dead connection)."""
    from pagefleet.cluster.bench import benchmark as bench_module

    real = bench_module._dataset

    def slow_dataset(*args, **kwargs):
        time.sleep(0.8)  # as tokenizing thousands of prompts does, the loop blocked
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_module, "_dataset", slow_dataset)
    base, _ = scripted_server("--ttft-ms", "5", "--itl-ms", "1", "--keepalive-s", "0.2")
    code, out, saved = bench(capsys, base, tmp_path / "r.json", "--num-prompts", "4", "--max-concurrency", "1",
                             "--random-input-len", "8", "--random-output-len", "3")
    assert [e for e in saved["errors"] if e] == []
    assert (code, saved["completed"], saved["failed"]) == (0, 4, 0)


def test_bad_flags_and_unreachable_servers_are_clear_errors(capsys, tmp_path, tokenizer_dir):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err
    assert main(["bench", "--model", "m", "--tokenizer", str(tokenizer_dir), "--max-concurrency", "0"]) == 2
    assert "--max-concurrency must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--model", "m", "--goodput", "ttft=3"]) == 2
    assert "bad goodput SLO 'ttft=3'" in capsys.readouterr().err
    assert main(["bench", "--model", "m", "--dataset", "file"]) == 2
    assert "--dataset file needs --dataset-path" in capsys.readouterr().err
