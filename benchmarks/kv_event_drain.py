"""What draining the KV event log costs a GPU-rate engine: a batch after every step against one
after a step at most every ``--interval-s`` (the publisher's pace, ``kv_publisher.ready``).

The simulated GPU engine alone (no Ray), KV events on, ``--concurrency`` requests in flight
(``--requests`` in all, 32-token prompts, ``--output-len`` tokens, ``ignore_eos``); the engine
thread's CPU time per step and per output token, alternating the two ways ``--rounds`` times.
A batch holds the step's cache changes and the worker's load (``worker_load``: a pass over the
running sequences), so per step it costs in proportion to the batch. One JSON line per run.

    .venv/bin/python benchmarks/kv_event_drain.py --out benchmarks/results/kv_event_drain_<machine>_<date>.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagefleet.worker.engine.llm_engine import LLMEngine
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.sampling_params import SamplingParams

from _machine import machine_with_load


def run(args: argparse.Namespace, every_step: bool) -> dict:
    engine = LLMEngine(EngineArgs(model=args.model, simulate=args.simulate, async_output_proc=False,
                                  max_num_seqs=max(args.concurrency, 1)))
    engine.enable_kv_events("w0")
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    added = 0

    def add() -> None:
        nonlocal added
        engine.add_request(str(added), [100 + (added * 7919 + j) % 30000 for j in range(32)], params)
        added += 1

    for _ in range(args.concurrency):
        add()
    steps = tokens = drains = 0
    cpu0 = time.thread_time()
    last = time.monotonic()
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += sum(len(s.token_ids) for s in delta.sequences)
            if delta.finished and added < args.requests:
                add()
        steps += 1
        now = time.monotonic()
        if every_step or now - last >= args.interval_s:
            engine.drain_kv_events()
            drains, last = drains + 1, now
    cpu = time.thread_time() - cpu0
    return {"drain": "every step" if every_step else f"every {args.interval_s:g} s", "steps": steps,
            "tokens": tokens, "drains": drains, "engine_cpu_us_per_step": round(1e6 * cpu / steps, 1),
            "engine_cpu_us_per_token": round(1e6 * cpu / tokens, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulate", default="h200")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--interval-s", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    for r in range(args.rounds):
        for every_step in (True, False):
            line = {**run(args, every_step), "concurrency": args.concurrency, "simulate": args.simulate,
                    "model": args.model, "round": r, **machine_with_load()}
            text = json.dumps(line)
            print(text, flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(text + "\n")


if __name__ == "__main__":
    main()
