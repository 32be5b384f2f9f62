"""The engine alone, driven the way `pagefleet bench --max-concurrency C` drives a server.

serving.py runs this in a process of its own (the engine's default torch threads, as a worker
replica has them) so its figures are what the Ray path is measured against. It builds an
``LLMEngine`` with `pagefleet serve`'s default options, keeps C requests in flight (the next
one is added as soon as one finishes, before the next step), stamps each step's deltas when the
step returns, and reduces the stamps with ``pagefleet bench``'s own metric code, so TTFT, TPOT,
ITL and output tok/s mean exactly what they mean for the servers. One JSON line per concurrency.

``--as-served``: build and step the engine as a worker replica's step thread does
(the platform's ``prepare_step_thread``: the lowest priority, the OpenMP team pinned one
thread per core) instead of as ``LLMEngine`` runs in a user's process (niceness 0, threads unpinned).
``--simulate GPU[:EFFICIENCY]``: the simulated GPU engine (docs/simulator.md); CKPT may then be
a model ``pagefleet plan`` knows by name.

    python _engine_alone.py [--as-served] [--simulate GPU[:F]] CKPT INPUT_LEN OUTPUT_LEN C:N [C:N ...]
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Callable

from pagefleet.cluster.bench.metrics import RequestResult, compute_metrics
from pagefleet.worker.engine.llm_engine import LLMEngine, resolve_device
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.model_executor.platform import platform_of
from pagefleet.worker.sampling_params import SamplingParams

from _proc_cpu import sched_per_token, thread_sched

PERCENTILES = [50.0, 99.0]


def run(engine: LLMEngine, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    # The servers' default sampling (temperature 1.0): neither `pagefleet bench` nor `vllm bench serve`
    # sends a temperature unless told, so the engine alone does the same work as the servers.
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    results = [RequestResult() for _ in prompts]
    last_chunk: dict[int, float] = {}
    waiting = list(range(len(prompts)))[::-1]
    running: set[int] = set()

    def take(deltas: list) -> None:
        now = time.perf_counter()
        for delta in deltas:
            i, r = int(delta.request_id), results[int(delta.request_id)]
            new = sum(len(s.token_ids) for s in delta.sequences)
            if new:
                if r.output_tokens == 0:
                    r.ttft = now - r.start_time
                else:
                    r.itl.append(now - last_chunk[i])
                last_chunk[i] = now
                r.output_tokens += new
            if delta.finished:
                r.latency, r.success = now - r.start_time, True
                running.discard(i)

    # As a served engine does: a step's deltas are taken while the next step runs (async output).
    engine.on_early_outputs = take
    started, cpu_started = time.perf_counter(), time.process_time()
    sched_started = thread_sched(os.getpid())  # this process's threads: the engine's and OpenMP's
    while waiting or running:
        while waiting and len(running) < concurrency:
            i = waiting.pop()
            results[i].start_time = time.perf_counter()
            results[i].prompt_len = len(prompts[i])
            engine.add_request(str(i), prompts[i], params)
            running.add(i)
        take(engine.step())
    cpu_s = time.process_time() - cpu_started  # every thread of this process
    sched = thread_sched(os.getpid())
    m = compute_metrics(results, time.perf_counter() - started, PERCENTILES)
    if m.total_output != output_len * len(prompts):
        raise RuntimeError(f"the engine made {m.total_output} tokens, not {output_len} x {len(prompts)}")
    return {"completed": m.completed, "failed": m.failed, "duration_s": round(m.duration, 3),
            "output_tok_s": round(m.output_throughput, 2),
            "ttft_p50_ms": round(m.ms["ttft"].median, 2), "ttft_p99_ms": round(m.ms["ttft"].percentiles[99.0], 2),
            "tpot_mean_ms": round(m.ms["tpot"].mean, 3), "itl_p50_ms": round(m.ms["itl"].median, 3),
            "cpu_ms_per_token": {"engine": round(1000 * cpu_s / m.total_output, 3)},
            "engine_threads": sched_per_token(sched_started, sched, m.total_output, m.duration)}


def random_prompts(engine: LLMEngine, input_len: int, seed: int = 0) -> Callable[[], list[int]]:
    """A maker of prompts of ``input_len`` random token ids (no special tokens), the same series
    for the same seed."""
    # Ids the tokenizer has (a simulated model's config may be wider than its demo tokenizer).
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    special = set(engine.tokenizer.all_special_ids)
    rng = random.Random(seed)

    def prompt() -> list[int]:
        out: list[int] = []
        while len(out) < input_len:
            t = rng.randrange(vocab)
            if t not in special:
                out.append(t)
        return out

    return prompt


def main() -> None:
    argv = sys.argv[1:]
    as_served = argv[:1] == ["--as-served"]
    if as_served:
        argv = argv[1:]
    simulate: dict = {}
    if argv[:1] == ["--simulate"] and len(argv) > 1:
        gpu, _, efficiency = argv[1].partition(":")
        simulate = {"simulate": gpu, "simulate_efficiency": float(efficiency or 1.0)}
        argv = argv[2:]
    if len(argv) < 4:
        sys.exit(__doc__)
    ckpt, input_len, output_len = argv[0], int(argv[1]), int(argv[2])
    plan = [tuple(int(x) for x in arg.split(":")) for arg in argv[3:]]
    args = EngineArgs(model=ckpt, log_stats_interval=0, **simulate)
    setup: dict = {"system": "engine-alone"}
    if as_served:  # this thread builds and steps the engine, as the replica's step thread does
        args, pinned = platform_of(args, resolve_device(args.device)).prepare_step_thread(args)
        setup = {"system": "engine-as-served", "pinned_threads": len(pinned)}
    engine = LLMEngine(args)
    prompt = random_prompts(engine, input_len)
    run(engine, [prompt() for _ in range(2)], 4, 2)  # warm-up, untimed
    for concurrency, num_prompts in plan:
        line = {**setup, "concurrency": concurrency, "num_prompts": num_prompts,
                **run(engine, [prompt() for _ in range(num_prompts)], output_len, concurrency)}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
