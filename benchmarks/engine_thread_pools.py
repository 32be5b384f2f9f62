"""One thread for the CPU engine's OpenMP work, or two: why a served engine is built on its step thread.

libgomp keeps a thread pool for each thread that starts a parallel region. Once its pools
together hold more threads than the process has cores, its barriers stop spinning
(GOMP_SPINCOUNT no longer applies; under OMP_WAIT_POLICY=PASSIVE they sleep at once), so every
region of a step ends with its threads asleep on a futex and starts by waking them. An engine
built on one thread (loading and packing the weights are parallel regions: that thread's pool)
and stepped on another (a second pool) is in that state; `AsyncLLMEngine` builds its engine on
its step thread so that it is not.

Each run is a process of its own, with the served engine's environment (`serving.alone_env`:
OMP_WAIT_POLICY=PASSIVE, and GOMP_SPINCOUNT where the engine has every core), driven as the
engine alone is in serving.py (`_engine_alone.run`, C requests in flight, 256 in, 64 out):

  one-thread    built and stepped on one thread (what `AsyncLLMEngine` does)
  two-threads   built on the main thread, stepped on another (the layout it avoids)

alternating, ``--rounds`` times. One JSON line per run and concurrency (output tok/s, TTFT p50,
TPOT, and the voluntary context switches per second of the process's threads: a barrier that
sleeps is one), then one summary line per concurrency with each mode's median and their ratio.

    python benchmarks/engine_thread_pools.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("one-thread", "two-threads")


def voluntary_switches() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            status = open(f"/proc/self/task/{tid}/status").read()
        except OSError:  # ended meanwhile
            continue
        total += int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return total


def child(mode: str, ckpt: str, input_len: int, output_len: int, concurrency: list[int]) -> None:
    from pagefleet.worker.engine.llm_engine import LLMEngine
    from pagefleet.worker.engine_args import EngineArgs

    from _engine_alone import random_prompts, run
    from serving import num_prompts

    built: dict = {}

    def build() -> None:
        built["engine"] = LLMEngine(EngineArgs(model=ckpt, log_stats_interval=0))

    def measure() -> None:
        engine = built["engine"]
        prompt = random_prompts(engine, input_len)
        run(engine, [prompt() for _ in range(2)], 4, 2)  # warm-up, untimed
        for c in concurrency:
            n = num_prompts(c)
            before, started = voluntary_switches(), time.monotonic()
            r = run(engine, [prompt() for _ in range(n)], output_len, c)
            per_s = (voluntary_switches() - before) / (time.monotonic() - started)
            print(json.dumps({"mode": mode, "concurrency": c, "num_prompts": n, "output_tok_s": r["output_tok_s"],
                              "ttft_p50_ms": r["ttft_p50_ms"], "tpot_mean_ms": r["tpot_mean_ms"],
                              "voluntary_switches_per_s": round(per_s, 1)}), flush=True)

    if mode == "one-thread":
        steps = threading.Thread(target=lambda: (build(), measure()))
    else:
        build()
        steps = threading.Thread(target=measure)
    steps.start()
    steps.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the random-weight 512x8 Llama)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    p.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    from serving import alone_env, checkpoint, emit

    ckpt = checkpoint(args.model)
    if args.child:
        child(args.child, ckpt, args.input_len, args.output_len, args.concurrency)
        return
    from _machine import machine

    info = {"machine": machine(), "input_len": args.input_len, "output_len": args.output_len}
    lines = []
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            done = subprocess.run([sys.executable, __file__, "--child", mode, "--model", ckpt, "--input-len",
                                   str(args.input_len), "--output-len", str(args.output_len), "--concurrency",
                                   *map(str, args.concurrency)], capture_output=True, text=True, timeout=1800,
                                  env=alone_env())
            if done.returncode != 0:
                raise RuntimeError(f"{mode} failed: {done.stderr[-2000:]}")
            for text in done.stdout.splitlines():
                line = {**json.loads(text), "round": round_, **info}
                lines.append(line)
                emit(line, args.out)
    for c in args.concurrency:
        med = {m: {k: statistics.median(x[k] for x in lines if x["mode"] == m and x["concurrency"] == c)
                   for k in ("output_tok_s", "tpot_mean_ms", "voluntary_switches_per_s")} for m in MODES}
        emit({"summary": "engine_thread_pools", "concurrency": c, "rounds": args.rounds, "median": med,
              "tok_s_one_over_two": round(med["one-thread"]["output_tok_s"] / med["two-threads"]["output_tok_s"], 3)},
             args.out)


if __name__ == "__main__":
    main()
