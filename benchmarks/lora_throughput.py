"""Offline throughput with LoRA adapters in the batch against the base model alone (issue 58's
criterion: 8 adapters >= 0.8x the base), same checkpoint, same seeded workload, same engine options.

The script writes one random-weight checkpoint (the demo "small" Llama: hidden 512, 8 layers,
fp32) and ``--adapters`` random PEFT-format adapters over it (rank ``--rank``, every projection
q/k/v/o/gate/up/down targeted, A and B non-zero), written directly in PEFT's file layout so that
PEFT itself is not needed. Systems, each run in this process on a fresh ``LLM``:

  base   the base model (enable_lora off)
  lora   enable_lora, max_loras = --adapters, requests spread round robin over the adapters

Runs alternate (base, lora, base, lora, ...) ``--repeat`` times; each prints one JSON line
(system, output_tokens, wall_s, output_tokens_per_s); a summary line gives the medians, the
ratio lora / base and the machine.

    python benchmarks/lora_throughput.py             # 64 requests, 8 adapters of rank 16
    python benchmarks/lora_throughput.py --quick     # smoke test: 8 short requests
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from _machine import machine_with_load

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapters(base: Path, out: Path, count: int, rank: int, seed: int) -> list[Path]:
    """``count`` adapters over ``base`` in PEFT's layout (adapter_config.json + adapter_model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    from pagefleet.worker.model_executor.model_config import load_model_config

    cfg = load_model_config(str(base))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(count):
        tensors = {}
        for layer in range(cfg.num_layers):
            for group, names in TARGETS.items():
                for name in names:
                    in_f, out_f = shapes[name]
                    key = f"base_model.model.model.layers.{layer}.{group}.{name}"
                    tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * in_f ** -0.5
                    tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
        path = out / f"adapter-{i}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(shapes),
            "bias": "none", "use_rslora": False, "use_dora": False}))
        paths.append(path)
    return paths


def run(system: str, base: Path, adapters: list[Path], workload: dict, rank: int) -> dict:
    from pagefleet.worker import LLM, SamplingParams
    from pagefleet.worker.lora.request import LoRARequest

    kwargs = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=rank) if system == "lora" else {}
    llm = LLM(model=str(base), dtype="float32", kv_cache_bytes=512 << 20, **kwargs)
    prompts = [{"prompt_token_ids": p} for p in workload["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload["outputs"]]
    loras = None
    if system == "lora":
        requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
        loras = [requests[i % len(requests)] for i in range(len(prompts))]
        for request in requests:  # read before the clock starts, as --lora-modules are at start
            llm.engine.add_lora(request)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"system": system, "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 short requests")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from pagefleet.cluster.demo.model import write_demo_checkpoint

    num, prompt_lens, output_lens = (8, (16, 32), (8, 16)) if args.quick else (args.requests, (64, 256), (64, 128))
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        base = write_demo_checkpoint(Path(tmp) / "base", size="small", arch="llama")
        adapters = write_adapters(base, Path(tmp) / "adapters", args.adapters, args.rank, args.seed)
        vocab = 32000
        workload = {"prompts": [[rng.randrange(5, vocab) for _ in range(rng.randint(*prompt_lens))]
                                for _ in range(num)],
                    "outputs": [rng.randint(*output_lens) for _ in range(num)]}
        results: dict[str, list[float]] = {"base": [], "lora": []}
        for _ in range(args.repeat):
            for system in ("base", "lora"):
                line = run(system, base, adapters, workload, args.rank)
                print(json.dumps({**line, "adapters": args.adapters, "rank": args.rank}), flush=True)
                results[system].append(line["output_tokens_per_s"])
    medians = {s: statistics.median(v) for s, v in results.items()}
    print(json.dumps({"summary": True, "median_output_tokens_per_s": medians,
                      "lora_over_base": round(medians["lora"] / medians["base"], 3), "adapters": args.adapters,
                      "rank": args.rank, "requests": num, "machine": machine_with_load()}), flush=True)


if __name__ == "__main__":
    main()
