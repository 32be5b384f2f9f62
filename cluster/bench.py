"""``pagefleet bench``: the serving benchmark, shaped like ``vllm bench serve``. Sends a dataset
of streaming requests to any OpenAI-compatible server at a Poisson (or gamma) arrival rate,
under an optional concurrency cap, over one HTTP session, and reports throughput and latency."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import aiohttp

from pagefleet.cluster import bench_datasets
from pagefleet.cluster.bench_client import BenchRequest, Endpoint, send
from pagefleet.cluster.bench_metrics import RequestResult, compute_metrics, parse_goodput
from pagefleet.cluster.bench_report import RunConfig, format_report, result_dict

ENDPOINTS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a running OpenAI-compatible server (like `vllm bench serve`)",
                       description="Send streaming requests to a running server (pagefleet, vLLM, ...) and report "
                                   "request/token throughput and TTFT, TPOT, ITL and end-to-end latency.")
    p.set_defaults(command="bench", run=run)
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", choices=list(ENDPOINTS))
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer directory for building prompts (default: the model's checkpoint "
                        "directory, when the server reports one that exists here)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("PAGEFLEET_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY or $PAGEFLEET_API_KEY)")
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                      choices=["random", "shared-prefix", "file"])
    data.add_argument("--dataset-path", default=None, help="for --dataset file: JSONL prompts or ShareGPT JSON")
    data.add_argument("--num-prompts", type=int, default=None,
                      help="requests to send (default 1000; shared-prefix: tenants x questions per tenant)")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform on [L(1-r), L(1+r)], 0 <= r < 1")
    data.add_argument("--shared-prefix-num-tenants", type=int, default=10)
    data.add_argument("--shared-prefix-questions-per-tenant", type=int, default=None,
                      help="default: --num-prompts / tenants")
    data.add_argument("--shared-prefix-len", type=int, default=256, help="tokens each tenant's prompts share")
    data.add_argument("--shared-prefix-question-len", type=int, default=256)
    data.add_argument("--shared-prefix-output-len", type=int, default=128)
    data.add_argument("--output-len", type=int, default=None, help="max_tokens for every request (file datasets)")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests/s, Poisson arrivals (gamma with --burstiness); inf: all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: < 1 burstier, > 1 more even")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--ignore-eos", action="store_true", help="generate max_tokens (implied by --dataset random)")
    load.add_argument("--temperature", type=float, default=None, help="default: the server's")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per request")
    res = p.add_argument_group("results")
    res.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", default="99",
                     help="comma-separated, e.g. 50,90,99")
    res.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    res.add_argument("--save-result", nargs="?", const="", default=None, metavar="FILE.json",
                     help="write the result as JSON with vLLM's keys (no FILE: a name from label, rate, model, date)")
    res.add_argument("--save-detailed", action="store_true", help="add per-request lists to the result file")
    res.add_argument("--label", default=None)
    res.add_argument("--plot", default=None, metavar="FILE.png", help="latency CDFs and throughput over time")
    res.add_argument("--disable-tqdm", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"pagefleet bench: error: {exc}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> tuple[list[float], dict[str, float] | None]:
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    try:
        percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--percentiles must be numbers, got {args.percentiles!r}") from None
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--percentiles must be in [0, 100], got {args.percentiles!r}")
    if args.dataset == "file" and not args.dataset_path:
        raise ValueError("--dataset file needs --dataset-path")
    if args.plot:
        import matplotlib  # noqa: F401  (fail now, not after the run)
    return percentiles, parse_goodput(args.goodput) if args.goodput else None


async def _main(args: argparse.Namespace) -> int:
    percentiles, slos = _check(args)
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model, root = await _first_model(session, base, headers) if args.model is None else (args.model, None)
        tokenizer_id = args.tokenizer or _local_dir(root) or _local_dir(args.model)
        if tokenizer_id is None:
            raise ValueError("no tokenizer: pass --tokenizer DIR (a local tokenizer; nothing is downloaded)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_id)
        requests = _dataset(args, tokenizer)
        extra = {}
        if args.ignore_eos or args.dataset == "random":
            extra["ignore_eos"] = True
        if args.temperature is not None:
            extra["temperature"] = args.temperature
        endpoint = Endpoint(base + args.endpoint, model, args.endpoint.endswith("chat/completions"), headers, extra)
        print(f"pagefleet bench: {len(requests)} requests of {args.dataset} to {endpoint.url} (model {model}); "
              f"request rate {args.request_rate}, burstiness {args.burstiness}, max concurrency "
              f"{args.max_concurrency}", flush=True)
        results, duration = await run_requests(session, endpoint, requests, args.request_rate, args.burstiness,
                                                args.max_concurrency, args.seed, tokenizer, not args.disable_tqdm)
    metrics = compute_metrics(results, duration, percentiles, slos)
    cfg = RunConfig(ENDPOINTS[args.endpoint], args.label, model, tokenizer_id, args.dataset, len(requests),
                    args.request_rate, args.burstiness, args.max_concurrency,
                    datetime.now().strftime("%Y%m%d-%H%M%S"))
    print(format_report(metrics, cfg, results), flush=True)
    if args.save_result is not None:
        path = Path(args.save_result or _default_name(cfg))
        path.write_text(json.dumps(result_dict(metrics, cfg, results, args.save_detailed)) + "\n")
        print(f"wrote {path}")
    if args.plot:
        from pagefleet.cluster.bench_plot import plot

        plot(results, metrics, args.plot, title=f"{model}: {len(requests)} x {args.dataset}, {args.endpoint}")
        print(f"wrote {args.plot}")
    return 0 if metrics.completed else 1


async def run_requests(session: aiohttp.ClientSession, endpoint: Endpoint, requests: list[BenchRequest],
                       request_rate: float, burstiness: float, max_concurrency: int | None, seed: int,
                       tokenizer=None, progress: bool = False) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (gaps drawn from a gamma distribution of shape
    ``burstiness`` and mean 1 / rate: Poisson at burstiness 1), at most ``max_concurrency`` in
    flight. Request ``i`` carries ``x-request-id: bench-<8 hex>-<i>``. Returns the results in
    dataset order and the wall time of the whole run."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    count = (lambda text: len(tokenizer.encode(text, add_special_tokens=False))) if tokenizer else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), file=sys.stderr)

    prefix = f"bench-{uuid.uuid4().hex[:8]}-"

    async def one(index: int, req: BenchRequest) -> RequestResult:
        if limit is None:
            result = await send(session, endpoint, req, f"{prefix}{index}", count)
        else:
            async with limit:
                result = await send(session, endpoint, req, f"{prefix}{index}", count)
        if bar is not None:
            bar.update(1)
        return result

    start = time.perf_counter()
    arrival = 0.0
    tasks = []
    for index, req in enumerate(requests):
        if request_rate != float("inf"):
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            arrival += rng.gammavariate(burstiness, 1 / (request_rate * burstiness))
        tasks.append(asyncio.create_task(one(index, req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration


def _dataset(args: argparse.Namespace, tokenizer) -> list[BenchRequest]:
    if args.dataset == "random":
        return bench_datasets.random_requests(tokenizer, args.num_prompts or 1000, args.random_input_len,
                                              args.output_len or args.random_output_len, args.random_range_ratio,
                                              args.seed)
    if args.dataset == "shared-prefix":
        tenants = args.shared_prefix_num_tenants
        questions = args.shared_prefix_questions_per_tenant
        if questions is None:
            questions = max(1, (args.num_prompts or 1000) // max(tenants, 1))
        elif args.num_prompts is not None and args.num_prompts != tenants * questions:
            raise ValueError(f"--num-prompts {args.num_prompts} != {tenants} tenants x {questions} questions")
        return bench_datasets.shared_prefix_requests(tokenizer, tenants, questions, args.shared_prefix_len,
                                                     args.shared_prefix_question_len,
                                                     args.output_len or args.shared_prefix_output_len, args.seed)
    return bench_datasets.file_requests(args.dataset_path, tokenizer, args.num_prompts or 1000, args.output_len,
                                        args.seed)


async def _first_model(session: aiohttp.ClientSession, base: str, headers: dict) -> tuple[str, str | None]:
    try:
        async with session.get(f"{base}/v1/models", headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {base}/v1/models answered HTTP {resp.status}: {(await resp.text())[:200]}")
            models = (await resp.json()).get("data") or []
    except aiohttp.ClientError as exc:
        raise RuntimeError(f"cannot reach {base}/v1/models: {exc}") from None
    if not models:
        raise RuntimeError(f"{base}/v1/models lists no model")
    return models[0]["id"], models[0].get("root")


def _local_dir(path: str | None) -> str | None:
    return path if path and Path(path).expanduser().is_dir() else None


def _default_name(cfg: RunConfig) -> str:
    concurrency = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency is not None else ""
    return f"{cfg.label or cfg.backend}-{cfg.request_rate}qps{concurrency}-{cfg.model_id.split('/')[-1]}-{cfg.date}.json"

