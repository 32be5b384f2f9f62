"""Grammar-constrained decoding against unconstrained decoding: output tokens per second.

One offline engine (``pagefleet.worker.LLM``, CPU, default kernels) over the small demo checkpoint
(Llama: hidden 512, 8 layers, vocab 32000, fp32, random weights) runs the same 16 requests (seeded
random prompt ids, temperature 1, one seed per request) two ways, alternating ``--rounds`` times:

  unconstrained  ignore_eos, exactly ``--max-tokens`` tokens each
  json_schema    structured_outputs.json: an object holding an array of exactly 64 person objects
                 (string, pattern, integer and array fields), which no request can finish within
                 ``--max-tokens``: each is cut at exactly that length too, so both sides make the
                 same number of tokens and only the grammar's cost differs

The grammar is compiled in an untimed warm-up. Prints one JSON line: each run's output tokens per
wall second and per CPU second of this process (steadier than wall time on a machine shared with
other work), each side's medians and their ratios (json_schema over unconstrained), and
``grammar_share``: the fraction of each json_schema run's wall time spent in the grammar's own work
(filling and applying the bitmask, advancing the matchers), timed around those calls.

    python benchmarks/structured_outputs.py            # 16 requests x 128 tokens, 3 rounds
    python benchmarks/structured_outputs.py --rounds 5 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from _machine import machine_with_load

NUM_REQUESTS = 16
PROMPT_LEN = 64
NUM_SPECIAL_TOKENS = 5  # ids 0..4 of the demo tokenizer; prompts avoid them
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "pattern": "^[a-z]{3,12}@[a-z]{3,8}\\.(com|org|net)$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "email", "age", "city", "tags"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 64, "maxItems": 64}},
    "required": ["people"],
    "additionalProperties": False,
}


class GrammarTimer:
    """Seconds spent in the grammar's calls: the sampler's masker (an engine attribute, replaced
    here) and SequenceGrammar.accept (wrapped for this process, which runs nothing else)."""

    def __init__(self, llm) -> None:
        from pagefleet.worker.structured.matcher import SequenceGrammar

        self.seconds = 0.0
        sampler = llm.engine.sampler
        sampler.mask_to_grammars = self._timed(sampler.mask_to_grammars)
        SequenceGrammar.accept = self._timed(SequenceGrammar.accept)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def run_once(llm, prompts: list[dict], params: list, timer: GrammarTimer) -> dict:
    """One batch: output tokens per wall and per CPU second, and the grammar's share of the wall
    time. Every request must make exactly max_tokens."""
    timer.seconds = 0.0
    cpu, start = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    if lengths != [p.max_tokens for p in params]:
        raise RuntimeError(f"requests came back with {lengths} tokens, not max_tokens each")
    return {"tokens_per_s": sum(lengths) / wall, "tokens_per_cpu_s": sum(lengths) / cpu,
            "grammar_share": timer.seconds / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="unconstrained/json_schema pairs, alternating")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--note", default=None, help="copied into the result line")
    args = parser.parse_args()
    # As offline_throughput.py's children: libgomp's spin-waiting on a shared 2-core machine makes
    # every small matmul wait for cores the spinners hold.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from pagefleet.cluster.demo.model import write_demo_checkpoint
    from pagefleet.worker import LLM, SamplingParams, StructuredOutputsParams

    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="pagefleet-bench-") as scratch:
        ckpt = write_demo_checkpoint(Path(scratch) / "demo-small-llama", size="small", arch="llama",
                                     dtype="float32", seed=0)
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        prompts = [{"prompt_token_ids": [rng.randrange(NUM_SPECIAL_TOKENS, vocab) for _ in range(PROMPT_LEN)]}
                   for _ in range(NUM_REQUESTS)]
        llm = LLM(model=str(ckpt), dtype="float32", device="cpu", kv_cache_bytes=256 << 20,
                  max_model_len=PROMPT_LEN + args.max_tokens)
        spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
        sides = {
            "unconstrained": [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
                              for i in range(NUM_REQUESTS)],
            "json_schema": [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True,
                                           structured_outputs=spec) for i in range(NUM_REQUESTS)],
        }
        for params in sides.values():  # warm-up: the kernels' first runs and the grammar's compile
            llm.generate(prompts[:2], params[:2])
        timer = GrammarTimer(llm)
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, params in sides.items():
                runs[side].append(run_once(llm, prompts, params, timer))
        llm.shutdown()

    def figures(side: str, key: str) -> list[float]:
        return [round(run[key], 3 if key == "grammar_share" else 2) for run in runs[side]]

    wall = {side: figures(side, "tokens_per_s") for side in sides}
    cpu = {side: figures(side, "tokens_per_cpu_s") for side in sides}
    median_wall = {side: statistics.median(v) for side, v in wall.items()}
    median_cpu = {side: statistics.median(v) for side, v in cpu.items()}
    line = {
        "benchmark": "structured_outputs",
        "model": "llama hidden 512, 8 layers, vocab 32000, float32, random weights",
        "num_requests": NUM_REQUESTS,
        "prompt_len": PROMPT_LEN,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "tokens_per_s": wall,
        "tokens_per_cpu_s": cpu,
        "median_tokens_per_s": median_wall,
        "median_tokens_per_cpu_s": median_cpu,
        "ratio": round(median_wall["json_schema"] / median_wall["unconstrained"], 3),
        "cpu_ratio": round(median_cpu["json_schema"] / median_cpu["unconstrained"], 3),
        "grammar_share": figures("json_schema", "grammar_share"),
        **machine_with_load(),
    }
    if args.note:
        line["note"] = args.note
    print(json.dumps(line))


if __name__ == "__main__":
    main()
