"""Offline throughput: pagefleet against transformers on the same checkpoint and workload.

The parent writes one random-weight checkpoint (Llama: hidden 512, 8 layers,
8 heads, 4 KV heads, vocab 32000, fp32), builds one seeded workload (random
prompt token ids, exact output lengths, EOS ignored) and runs each system in a
fresh process with 2 torch threads:

  pagefleet     pagefleet.worker.LLM, continuous batching over the paged KV cache
  hf-static-8   transformers `generate`, static batches of 8 in workload order
  hf-static-32  the same with batches of 32
  hf-cb         transformers' own continuous batching (the manager behind `generate_batch`)

Each run prints one JSON line (system, output_tokens, wall_s,
output_tokens_per_s, peak_rss_mib, ...); the parent then prints a summary line
with the ratios and the machine it ran on.

    python benchmarks/offline_throughput.py            # full: 64 requests
    python benchmarks/offline_throughput.py --quick    # smoke test: 8 short requests
    python benchmarks/offline_throughput.py --metrics 3  # serving path, metrics off/on, alternated 3 times

With --metrics the systems are the serving path, ``AsyncLLMEngine`` in a process with a local Ray
(pagefleet-serving), and the same with the engine metrics recorded through ``ray.util.metrics``
(pagefleet-serving-metrics); the summary's ``metrics_on_throughput_ratio`` is the median
throughput with metrics over the median without.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_SYSTEMS = ("pagefleet", "hf-static-8", "hf-static-32", "hf-cb")
# The serving path (engine thread on a local Ray) without and with metrics: --metrics runs these.
METRICS_SYSTEMS = ("pagefleet-serving", "pagefleet-serving-metrics")
SYSTEMS = DEFAULT_SYSTEMS + METRICS_SYSTEMS
NUM_SPECIAL_TOKENS = 5  # ids 0..4 of the demo tokenizer; prompts avoid them


def build_workload(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                   vocab_size: int, seed: int) -> dict:
    """Seeded random prompt ids (not text, so no tokenizer is involved) and exact output lengths."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        length = rng.randint(*prompt_lens)
        prompts.append([rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(length)])
        outputs.append(rng.randint(*output_lens))
    return {"prompts": prompts, "output_lens": outputs, "seed": seed}


def machine_info() -> dict:
    import torch
    import transformers

    cpu_model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu_model,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": 2,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------- child side


def run_one(system: str, ckpt: str, workload_path: str) -> dict:
    import torch

    torch.set_num_threads(2)
    import _offline_runners as runners

    data = json.loads(Path(workload_path).read_text())
    workload = runners.Workload(data["prompts"], data["output_lens"])
    config = json.loads((Path(ckpt) / "config.json").read_text())
    if system == "pagefleet":
        result = runners.run_pagefleet(ckpt, workload, config)
    elif system == "hf-static-8":
        result = runners.run_hf_static(ckpt, workload, batch_size=8)
    elif system == "hf-static-32":
        result = runners.run_hf_static(ckpt, workload, batch_size=32)
    elif system == "hf-cb":
        result = runners.run_hf_continuous(ckpt, workload)
    elif system in METRICS_SYSTEMS:
        result = runners.run_pagefleet_serving(ckpt, workload, config, metrics=system.endswith("-metrics"))
    else:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    line = {
        "system": system,
        "num_requests": len(workload.prompts),
        "prompt_tokens": sum(len(p) for p in workload.prompts),
        "output_tokens": result.output_tokens,
        "generated_tokens": result.generated_tokens,
        "wall_s": round(result.wall_s, 3),
        "output_tokens_per_s": round(result.output_tokens / result.wall_s, 2),
        "peak_rss_mib": round(runners.peak_rss_mib(), 1),
        # Other work on the machine slows every system; a 1-minute load well
        # above the thread count means this line's timing is suspect.
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    if result.note:
        line["note"] = result.note
    line.update(result.extra or {})
    return line


# --------------------------------------------------------------- parent side


def run_child(system: str, ckpt: Path, workload_path: Path, timeout_s: float, omp_wait_policy: str) -> dict:
    # libgomp spin-waits by default; on a machine with other load that makes
    # each small matmul of a 2-thread main loop cost ~15 ms instead of ~0.5 ms,
    # while transformers' continuous batching, whose loop runs in a background
    # thread, escapes it. PASSIVE puts every system on the same footing.
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false",
               OMP_WAIT_POLICY=omp_wait_policy)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run", system, "--ckpt", str(ckpt),
           "--workload", str(workload_path)]
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if result.get("system") == system:
                return result
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"system": system, "error": f"exit code {proc.returncode}: {tail}"}


def describe_model(config: dict) -> str:
    return (f"{config['model_type']} hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
            f"{config['num_attention_heads']} heads, {config['num_key_value_heads']} kv heads, "
            f"vocab {config['vocab_size']}, {config.get('dtype', 'float32')}, random weights")


def summarize(results: list[dict], machine: dict, workload: dict, model: str) -> dict:
    ok = {r["system"]: r for r in results if "error" not in r}
    summary = {
        "summary": "offline_throughput",
        "model": model,
        "workload": {"num_requests": len(workload["prompts"]),
                     "prompt_tokens": sum(len(p) for p in workload["prompts"]),
                     "output_tokens": sum(workload["output_lens"]), "seed": workload["seed"]},
        "output_tokens_per_s": {s: r["output_tokens_per_s"] for s, r in ok.items()},
        "machine": machine,
    }
    hf = {s: r for s, r in ok.items() if s.startswith("hf-")}
    if "pagefleet" in ok and hf:
        best = max(hf, key=lambda s: hf[s]["output_tokens_per_s"])
        pf = ok["pagefleet"]
        summary["best_transformers"] = best
        summary["throughput_ratio_vs_best_transformers"] = round(
            pf["output_tokens_per_s"] / hf[best]["output_tokens_per_s"], 3)
        summary["throughput_ratio_vs"] = {
            s: round(pf["output_tokens_per_s"] / r["output_tokens_per_s"], 3) for s, r in hf.items()}
        if "hf-cb" in ok:
            summary["peak_rss_ratio_vs_hf_cb"] = round(pf["peak_rss_mib"] / ok["hf-cb"]["peak_rss_mib"], 3)
    runs = {s: [r["output_tokens_per_s"] for r in results if r.get("system") == s and "error" not in r]
            for s in METRICS_SYSTEMS}
    if all(runs.values()):
        off, on = (statistics.median(runs[s]) for s in METRICS_SYSTEMS)
        summary["metrics_runs_output_tokens_per_s"] = runs
        summary["metrics_on_throughput_ratio"] = round(on / off, 4)  # median with metrics / median without
        cpu = {s: [r["output_tokens_per_cpu_s"] for r in results if r.get("system") == s and "error" not in r]
               for s in METRICS_SYSTEMS}
        off, on = (statistics.median(cpu[s]) for s in METRICS_SYSTEMS)
        summary["metrics_on_tokens_per_cpu_s_ratio"] = round(on / off, 4)
        summary["metrics_hooks_share_of_wall_max"] = max(
            r["metrics_hooks_share_of_wall"] for r in results if r.get("system") == METRICS_SYSTEMS[1] and "error" not in r)
    failed = [r["system"] for r in results if "error" in r]
    if failed:
        summary["failed"] = failed
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: 8 requests, prompts 16-64, outputs 8-16")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--metrics", type=int, metavar="N", default=0,
                        help="instead: the serving path without and with metrics, alternated N times each")
    parser.add_argument("--ckpt", help="checkpoint dir: reused if it holds a config.json, else written there")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per system")
    parser.add_argument("--omp-wait-policy", choices=("PASSIVE", "ACTIVE"), default="PASSIVE",
                        help="OMP_WAIT_POLICY of every run (ACTIVE suits only an otherwise idle machine)")
    parser.add_argument("--run", choices=SYSTEMS, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--workload", help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args(argv)

    if args.run:
        print(json.dumps(run_one(args.run, args.ckpt, args.workload)), flush=True)
        return 0

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.metrics:
        systems = list(METRICS_SYSTEMS) * args.metrics  # A/B/A/B: machine noise falls on both alike
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    with tempfile.TemporaryDirectory(prefix="pagefleet-bench-") as scratch:
        ckpt = Path(args.ckpt) if args.ckpt else Path(scratch) / "ckpt"
        if not (ckpt / "config.json").is_file():
            from pagefleet.cluster.demo_model import write_demo_checkpoint

            write_demo_checkpoint(ckpt, size="small", arch="llama", dtype="float32", seed=0)
        config = json.loads((ckpt / "config.json").read_text())
        vocab_size = config["vocab_size"]
        if args.quick:
            workload = build_workload(8, (16, 64), (8, 16), vocab_size, args.seed)
        else:
            workload = build_workload(64, (32, 512), (16, 256), vocab_size, args.seed)
        workload_path = Path(scratch) / "workload.json"
        workload_path.write_text(json.dumps(workload))
        results = []
        for system in systems:
            result = run_child(system, ckpt, workload_path, args.timeout, args.omp_wait_policy)
            print(json.dumps(result), flush=True)
            results.append(result)
    machine = dict(machine_info(), omp_wait_policy=args.omp_wait_policy)
    print(json.dumps(summarize(results, machine, workload, describe_model(config))), flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
