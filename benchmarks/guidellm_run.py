"""GuideLLM (a serving benchmark client pagefleet did not write) against `pagefleet serve`:
synthetic prompts at fixed concurrencies, streamed completions; prints one JSON line per
concurrency with its requests, errors, throughput and latencies as GuideLLM measured them.

GuideLLM runs from a venv of its own (`--guidellm-venv`, made by `--setup`), not a test dependency.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _machine import machine_with_load
from serving import checkpoint, emit, start_pagefleet

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = HERE / ".venv-guidellm"
# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build into the venv.
SETUP_PACKAGES = ["torch==2.13.0", "guidellm==0.8.1"]


def setup(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *SETUP_PACKAGES], check=True)


def guidellm(venv: Path, base: str, model: str, ckpt: str, args, out: Path) -> dict:
    subprocess.run([
        str(venv / "bin" / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={base},model={model},request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={args.concurrency[0]}",
        "--override", "profile.streams", ",".join(str(c) for c in args.concurrency),
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={ckpt}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive"], check=True)
    return json.loads(out.read_text())


def wait_healthy(base: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base}/health not 200 after {timeout_s:g} s")
        time.sleep(1)


def summaries(report: dict) -> list[dict]:
    """One line per concurrency from GuideLLM's report: its own figures, renamed only."""
    lines = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]
        totals = m["request_totals"]
        lines.append({
            "concurrency": bench["config"]["strategy"]["streams"],
            "requests_successful": totals["successful"], "requests_errored": totals["errored"],
            "requests_incomplete": totals["incomplete"],
            "output_tok_per_s": m["output_tokens_per_second"]["successful"]["mean"],
            "ttft_ms_p50": m["time_to_first_token_ms"]["successful"]["median"],
            "itl_ms_p50": m["inter_token_latency_ms"]["successful"]["median"],
        })
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the small demo Llama, fp32)")
    parser.add_argument("--guidellm-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--setup", action="store_true", help="make the GuideLLM venv first")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=48, help="requests at each concurrency")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()
    if args.setup:
        setup(args.guidellm_venv)
    ckpt = checkpoint(args.model)
    with tempfile.TemporaryDirectory(prefix="pagefleet-guidellm-") as tmp:
        workdir = Path(tmp)
        server = start_pagefleet(ckpt, workdir)
        try:
            server.wait_ready()
            wait_healthy(server.base)  # GuideLLM checks /health once, before its first request
            model = httpx.get(f"{server.base}/v1/models", timeout=30).json()["data"][0]["id"]
            report = guidellm(args.guidellm_venv, server.base, model, ckpt, args, workdir / "guidellm.json")
        finally:
            server.stop()
    for line in summaries(report):
        emit({"benchmark": "guidellm", "checkpoint": ckpt, "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens, **line, "machine": machine_with_load()}, args.out)


if __name__ == "__main__":
    main()
