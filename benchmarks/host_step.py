"""The host's share of a GPU step that no overlap hides: building the step's input from the
scheduler's output (``build_step_input``) and writing it into the pinned step buffers
(``StepBuffers.fill``), measured on this CPU over the real engine's steps.

The real engine runs on a simulated GPU (``--simulate``), so its steps are what a GPU engine
schedules: requests of one prompt length with output lengths spread evenly up to
``--output-len``, twice as many as ``--batch`` seats, so sequences end at staggered steps and
waiting ones take their seats. Each decode step is also filled into a CPU ``StepBuffers`` of
the CUDA runner's shape, padded to its graph bucket; the host-to-device copy that follows on a
GPU is not part of it. Prints one JSON line per batch size.

  python benchmarks/host_step.py [--simulate h200] [--batches 64 256] [--prompt-len 2048] [--output-len 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.engine import step_loop
from pagefleet.worker.model_executor.cuda_graphs import decode_buckets
from pagefleet.worker.model_executor.step_buffers import StepBuffers


def run(gpu: str, model: str, batch: int, prompt_len: int, output_len: int) -> dict:
    # Every step a whole scheduling round (async scheduling off: no step is launched ahead).
    llm = LLM(model=model, simulate=gpu, max_num_seqs=batch, max_num_batched_tokens=8192, async_scheduling=False)
    engine = llm.engine
    cfg = engine.model_config
    buffers = StepBuffers(8192, batch, -(-cfg.max_model_len // engine.args.block_size), torch.device("cpu"))
    buckets = decode_buckets(batch)
    build_us: list[float] = []
    fill_us: list[float] = []
    real_build, real_execute = step_loop.build_step_input, engine.executor.execute

    def build(*args):
        t = time.perf_counter()
        step = real_build(*args)
        build_us.append((time.perf_counter() - t) * 1e6)
        return step

    def execute(step, prev_tokens=None):
        b = len(step.seq_lens)
        if len(step.input_ids) == b:  # decode: what DecodeGraphs.run fills
            rows = next(r for r in buckets if r >= b)
            t = time.perf_counter()
            buffers.fill(step, pad_to=rows)
            fill_us.append((time.perf_counter() - t) * 1e6)
        else:
            build_us.pop()  # count decode steps only
        return real_execute(step, prev_tokens)

    step_loop.build_step_input, engine.executor.execute = build, execute
    try:
        n = 2 * batch
        prompts = [{"prompt_token_ids": [(7 * i + j) % 30000 + 100 for j in range(prompt_len)]} for i in range(n)]
        params = [SamplingParams(temperature=0.0, max_tokens=1 + i * output_len // n, ignore_eos=True)
                  for i in range(n)]
        llm.generate(prompts, params)
    finally:
        step_loop.build_step_input = real_build
        llm.shutdown()
    return {"gpu": gpu, "model": model, "batch": batch, "prompt_len": prompt_len, "output_len": output_len,
            "decode_steps": len(fill_us), "build_us_median": round(statistics.median(build_us), 1),
            "fill_us_median": round(statistics.median(fill_us), 1),
            "build_us_mean": round(statistics.fmean(build_us), 1), "fill_us_mean": round(statistics.fmean(fill_us), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulate", default="h200")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--label", default=None, help="a name for the code measured, printed on each line")
    args = parser.parse_args()
    for batch in args.batches:
        line = run(args.simulate, args.model, batch, args.prompt_len, args.output_len)
        if args.label:
            line["label"] = args.label
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
