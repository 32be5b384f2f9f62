"""The simulated GPU engine alone (``--simulate``), no Ray, no HTTP: how its step time follows the
roofline, what the host spends per step and per token, and what idle engines cost.

For each batch size, ``--steps`` decode steps of that many sequences (prompts of ``--prompt-len``
tokens, ``ignore_eos``): the model's time per step (the plan's roofline / efficiency), the wall
time per step, the time past the model's (the host's own work: schedule, draw, detokenize; and
the sleep's overshoot), and the process's CPU time per step and per token. Then ``--idle-engines``
AsyncLLMEngines left idle for ``--idle-s``: the process's CPU seconds per second.

    .venv/bin/python benchmarks/simulated_engine.py --simulate h200 --model llama-3-8b \\
        --out benchmarks/results/simulated_engine_<machine>_<date>.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams
from pagefleet.worker.engine.llm_engine import LLMEngine

from _machine import machine_with_load


def decode_run(args: argparse.Namespace, batch: int) -> dict:
    engine = LLMEngine(EngineArgs(model=args.model, simulate=args.simulate, max_num_seqs=max(batch, 1),
                                  simulate_efficiency=args.efficiency))
    runner = engine.executor.runner
    modelled: list[float] = []
    step_seconds = runner.step_seconds
    runner.step_seconds = lambda step: modelled.append(step_seconds(step)) or modelled[-1]
    try:
        for i in range(batch):
            prompt = [1000 + (i * 7919 + j) % 20000 for j in range(args.prompt_len)]
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.steps + 1, ignore_eos=True, seed=i))
        engine.step()  # the prefill of every prompt (max_num_batched_tokens permitting)
        while len(engine.scheduler.running) < batch or any(s.num_computed_tokens < s.num_prompt_tokens
                                                            for s in engine.scheduler.running):
            engine.step()
        modelled.clear()
        walls = []
        cpu = time.process_time()
        for _ in range(args.steps):
            started = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - started)
        cpu = time.process_time() - cpu
    finally:
        engine.shutdown()
    extra = sorted(w - m for w, m in zip(walls, modelled))
    return {"kind": "decode", "batch": batch, "steps": len(walls),
            "model_ms_per_step": round(statistics.mean(modelled) * 1e3, 4),
            "wall_ms_per_step": round(statistics.mean(walls) * 1e3, 4),
            "wall_below_model_steps": sum(w < m for w, m in zip(walls, modelled)),
            "over_model_ms_p50": round(extra[len(extra) // 2] * 1e3, 4),
            "over_model_ms_p99": round(extra[int(len(extra) * 0.99)] * 1e3, 4),
            "cpu_ms_per_step": round(cpu / len(walls) * 1e3, 4),
            "cpu_us_per_token": round(cpu / (len(walls) * batch) * 1e6, 2)}


def idle_run(args: argparse.Namespace) -> dict:
    engine_args = EngineArgs(model=args.model, simulate=args.simulate)
    engines = [AsyncLLMEngine(engine_args) for _ in range(args.idle_engines)]
    try:
        async def one(engine):
            async for _ in engine.generate("warm", [1000, 1001, 1002], SamplingParams(max_tokens=2)):
                pass

        async def warm():
            await asyncio.gather(*(one(e) for e in engines))

        asyncio.run(warm())
        time.sleep(1.0)
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(args.idle_s)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        for engine in engines:
            engine.shutdown()
    return {"kind": "idle", "engines": args.idle_engines, "seconds": round(wall, 2),
            "cpu_s_per_s_all": round(cpu / wall, 5), "cpu_s_per_s_per_engine": round(cpu / wall / len(engines), 6)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulate", default="h200")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--efficiency", type=float, default=1.0)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--idle-engines", type=int, default=16)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    head = {"benchmark": "simulated_engine", "simulate": args.simulate, "model": args.model,
            "efficiency": args.efficiency, "machine": machine_with_load()}
    rows = [decode_run(args, int(b)) for b in args.batches.split(",")] + [idle_run(args)]
    lines = [json.dumps({**head, **row}) for row in rows]
    print("\n".join(lines))
    if args.out is not None:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
