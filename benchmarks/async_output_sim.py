"""Async output processing on a simulated GPU: offline throughput of the real engine with the
host's per-step output work (detokenizing, stop checks, deltas) done after each step, against
done while the next step's device time runs (``--async-output-proc``).

The simulated GPU (``--simulate``) queues each step and returns at once, as a CUDA launch does,
so host work overlaps its device time as it would a real GPU's. Prints one JSON line per run
and one line of ratios; runs alternate between the two settings.

  python benchmarks/async_output_sim.py [--simulate h200] [--batches 64 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagefleet.worker import LLM, SamplingParams


def run(gpu: str, model: str, batch: int, prompt_len: int, output_len: int, async_output: bool) -> float:
    llm = LLM(model=model, simulate=gpu, max_num_seqs=max(batch, 64), max_num_batched_tokens=8192,
              async_output_proc=async_output)
    try:
        prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + prompt_len))} for i in range(batch)]
        llm.generate(prompts[:4], SamplingParams(max_tokens=2))
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        return batch * output_len / (time.perf_counter() - t0)
    finally:
        llm.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulate", default="h200")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for batch in args.batches:
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for async_output in (False, True):
                # The medians are taken over the rates as printed, so a reader can recompute them.
                rate = round(run(args.simulate, args.model, batch, args.prompt_len, args.output_len, async_output), 1)
                rates[async_output].append(rate)
                print(json.dumps({"gpu": args.simulate, "model": args.model, "batch": batch,
                                  "async_output_proc": async_output, "output_tokens_per_s": rate}),
                      flush=True)
        print(json.dumps({"gpu": args.simulate, "batch": batch, "median_off": round(statistics.median(rates[False])),
                          "median_on": round(statistics.median(rates[True])),
                          "on_over_off": round(statistics.median(rates[True]) / statistics.median(rates[False]), 3)}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
