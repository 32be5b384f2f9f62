"""``pagefleet bench``: the serving benchmark, shaped like ``vllm bench serve``. Sends a dataset
of streaming requests to any OpenAI-compatible server at a Poisson (or gamma) arrival rate,
under an optional concurrency cap, over one HTTP session, and reports throughput and latency."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import aiohttp

from pagefleet.cluster.bench import datasets as bench_datasets
from pagefleet.cluster.bench.args import ENDPOINTS, BenchArgs
from pagefleet.cluster.bench.client import BenchRequest, Endpoint, send
from pagefleet.cluster.bench.metrics import RequestResult, compute_metrics
from pagefleet.cluster.bench.report import RunConfig, format_report, result_dict
from pagefleet.worker.options import add_cli_args, from_namespace
from pagefleet.worker.simulated.checkpoint import demo_cache_root


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a running OpenAI-compatible server (like `vllm bench serve`)",
                       description="Send streaming requests to a running server (pagefleet, vLLM, ...) and report "
                                   "request/token throughput and TTFT, TPOT, ITL and end-to-end latency.")
    p.set_defaults(command="bench", run=run)
    add_cli_args(p, BenchArgs)


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(from_namespace(BenchArgs, args)))
    except (ValueError, OSError, RuntimeError) as exc:  # OSError: a missing dataset file or tokenizer
        print(f"pagefleet bench: error: {exc}", file=sys.stderr)
        return 2


async def _main(args: BenchArgs) -> int:
    percentiles, slos = args.percentile_list(), args.goodput_slos()
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    if args.model:
        model = args.model
    else:  # its own connection: building the prompts below takes seconds, longer than many servers
        async with aiohttp.ClientSession(timeout=timeout) as probe:  # keep an idle one (uvicorn: 5 s)
            model = await _first_model(probe, base, headers)
    tokenizer_id = args.tokenizer or _local_dir(model) or _local_dir(demo_cache_root() / model)
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
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        results, duration, client_cpu_s = await run_requests(session, endpoint, requests, args.request_rate,
                                                              args.burstiness, args.max_concurrency, args.seed,
                                                              tokenizer, not args.disable_tqdm)
    metrics = compute_metrics(results, duration, percentiles, slos, client_cpu_s)
    cfg = RunConfig(ENDPOINTS[args.endpoint], args.label, model, tokenizer_id, args.dataset, len(requests),
                    args.request_rate, args.burstiness, args.max_concurrency,
                    datetime.now().strftime("%Y%m%d-%H%M%S"))
    print(format_report(metrics, cfg, results), flush=True)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result_dict(metrics, cfg, results, args.save_detailed)) + "\n")
        print(f"wrote {args.save_result}")
    if args.plot:
        from pagefleet.cluster.bench.plot import plot

        plot(results, metrics, args.plot, title=f"{model}: {len(requests)} x {args.dataset}, {args.endpoint}")
        print(f"wrote {args.plot}")
    return 0 if metrics.completed else 1


async def run_requests(session: aiohttp.ClientSession, endpoint: Endpoint, requests: list[BenchRequest],
                       request_rate: float, burstiness: float, max_concurrency: int | None, seed: int,
                       tokenizer=None, progress: bool = False) -> tuple[list[RequestResult], float, float]:
    """Send every request at its arrival time (gaps drawn from a gamma distribution of shape
    ``burstiness`` and mean 1 / rate: Poisson at burstiness 1), at most ``max_concurrency`` in
    flight. Request ``i`` carries ``x-request-id: bench-<8 hex>-<i>``. Returns the results in
    dataset order, the wall time of the whole run and this process's CPU time over it (every
    thread; the collection before the run, the tokenizer and the dataset are not counted)."""
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

    # What exists now (tokenizer, dataset, imports) is moved out of the collector's sight, as
    # vLLM's bench does: a full collection over it would be a pause every stream sees.
    gc.collect()
    gc.freeze()
    start, cpu_started = time.perf_counter(), time.process_time()
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
    duration, cpu_s = time.perf_counter() - start, time.process_time() - cpu_started
    gc.unfreeze()
    if bar is not None:
        bar.close()
    return list(results), duration, cpu_s


def _dataset(args: BenchArgs, tokenizer) -> list[BenchRequest]:
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


async def _first_model(session: aiohttp.ClientSession, base: str, headers: dict) -> str:
    try:
        async with session.get(f"{base}/v1/models", headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {base}/v1/models answered HTTP {resp.status}: {(await resp.text())[:200]}")
            models = (await resp.json()).get("data") or []
    except aiohttp.ClientError as exc:
        raise RuntimeError(f"cannot reach {base}/v1/models: {exc}") from None
    if not models:
        raise RuntimeError(f"{base}/v1/models lists no model")
    return models[0]["id"]


def _local_dir(path: str | Path) -> str | None:
    """``path`` when it is a directory here (a model served from a local checkpoint, or one that
    pagefleet wrote into its own cache: the demo model). Servers do not say where their
    checkpoint lives (pagefleet's /v1/models never shows a path)."""
    return str(path) if Path(path).expanduser().is_dir() else None
