"""Overlapping the host with a simulated GPU: offline throughput of the real engine stepping
synchronously, with async output processing (``--async-output-proc``: detokenizing, stop checks
and deltas done while the next step's device time runs), and with async scheduling on top
(``--async-scheduling``: the next decode step launched before the host has this one's tokens).

The simulated GPU (``--simulate``) queues each step and returns at once, as a CUDA launch does,
so host work overlaps its device time as it would a real GPU's. Prints one JSON line per run
and one line of ratios per batch, each setting's median over the synchronous one's; runs
alternate between the settings.

  python benchmarks/async_output_sim.py [--simulate h200] [--batches 64 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagefleet.worker import LLM, SamplingParams

# Setting name -> (async_output_proc, async_scheduling).
SETTINGS = {"sync": (False, False), "async_output": (True, False), "async_scheduling": (True, True)}


def run(gpu: str, model: str, batch: int, prompt_len: int, output_len: int, setting: str) -> float:
    async_output, async_scheduling = SETTINGS[setting]
    llm = LLM(model=model, simulate=gpu, max_num_seqs=max(batch, 64), max_num_batched_tokens=8192,
              async_output_proc=async_output, async_scheduling=async_scheduling)
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
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="the first is the baseline of the ratios")
    args = parser.parse_args()
    for batch in args.batches:
        rates: dict[str, list[float]] = {s: [] for s in args.settings}
        for _ in range(args.rounds):
            for setting in args.settings:
                # The medians are taken over the rates as printed, so a reader can recompute them.
                rate = round(run(args.simulate, args.model, batch, args.prompt_len, args.output_len, setting), 1)
                rates[setting].append(rate)
                print(json.dumps({"gpu": args.simulate, "model": args.model, "batch": batch, "setting": setting,
                                  "output_tokens_per_s": rate}), flush=True)
        medians = {s: statistics.median(r) for s, r in rates.items()}
        base = args.settings[0]
        print(json.dumps({"gpu": args.simulate, "batch": batch, "medians": {s: round(m) for s, m in medians.items()},
                          "over": base, "ratios": {s: round(m / medians[base], 3) for s, m in medians.items()
                                                   if s != base}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
