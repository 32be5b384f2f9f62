"""Serving speed: `pagefleet serve` over HTTP against the engine alone, and `vllm serve`.

One invocation measures, one after the other on the same checkpoint (by default the
random-weight Llama of the engine benchmarks: hidden 512, 8 layers, GQA 8/4, vocab 32000,
fp32) and the same workload (`--dataset random`, prompts of 256 tokens, 64 output tokens,
EOS ignored), at each concurrency (1, 4, 16):

  engine-alone     LLMEngine in a process of its own, C requests kept in flight
                   (benchmarks/_engine_alone.py): what the Ray path is measured against
  pagefleet-serve  `pagefleet serve` (local Ray, one worker replica, default options),
                   driven by `pagefleet bench --max-concurrency C`
  vllm-serve       `vllm serve` from vLLM's CPU backend, when its venv exists (--vllm-venv),
                   driven by the same `pagefleet bench` command; its defaults keep one core
                   for its engine-core process (on 2 cores: one compute thread)
  vllm-serve-allcores  the same with no core kept back (VLLM_CPU_NUM_OF_RESERVED_CPU=0), as
                   pagefleet serve computes on every core

Each line: output tok/s, TTFT p50/p99, TPOT mean, ITL p50, the machine and its load average
before the run, and the server's CPU time per output token by process role (engine thread,
worker, ingress, proxy, ...; benchmarks/_proc_cpu.py), and the client's own (`pagefleet bench`
over its requests: here it computes on the server's cores, a user's client does not): on a
shared machine wall-clock figures carry the neighbours' load, CPU per token does not. For the
engine alone and pagefleet serve, ``engine_threads``: the engine's compute threads' CPU and run-queue wait per output token and
their involuntary context switches per second (preempted, or out of time slice). Then one line per concurrency with
the overhead of the Ray path (TTFT p50 and TPOT over the engine alone, tok/s as a fraction of
it and of vllm-serve's, the engine threads' added run-queue wait), and, with vLLM
installed, one line for `vllm bench serve --model CKPT` run against pagefleet (every request
must complete).

The whole comparison runs ``--rounds`` times (3 by default), the systems in reverse order every
other round, and every line carries its round. A shared machine's speed can move by a quarter within
minutes (the same server, the same workload: 157 then 235 tok/s a few runs apart), more than
the overhead being measured, so a ratio is only taken between runs of one round, and the last
lines (``ray_path_overhead_median``) give each overhead figure's value in every round and the
median over rounds.

``--simulate GPU``: the simulated GPU engine (docs/simulator.md) on both sides, the model a
checkpoint or a name ``pagefleet plan`` knows (default ``llama-3-8b``): what the serving path
adds at GPU token rates. ``--workers N`` serves from N worker replicas; the engine alone is then
N engines, each at C/N requests in flight (its lines' tok/s are the N engines' together).

    python benchmarks/serving.py                      # all of it
    python benchmarks/serving.py --systems engine-alone pagefleet-serve --concurrency 1
    python benchmarks/serving.py --model /models/x    # another checkpoint
    python benchmarks/serving.py --simulate h200 --systems engine-alone pagefleet-serve \\
        --input-len 32 --output-len 128 --concurrency 1 16 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping

import httpx

from pagefleet.cluster.cpu_priority import descendants
from pagefleet.worker.cpu.threads import (
    LOWEST_NICE,
    available_cores,
    compute_thread_env,
    cpu_compute_threads,
    libgomp_spins,
)

from _machine import machine
from _proc_cpu import per_token_ms, role_of, sched_per_token, thread_sched, tree_cpu_s

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
SYSTEMS = ("engine-alone", "pagefleet-serve", "vllm-serve", "vllm-serve-allcores")
DEFAULT_VLLM_VENV = "/work/vllm-cpu-venv"
KEYS = ("completed", "failed", "duration_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms",
        "itl_p50_ms")


def num_prompts(concurrency: int, per_stream: int = 3) -> int:
    """Enough requests for ``per_stream`` rounds at C (and 8 at C=1), so each percentile has samples."""
    return max(8, per_stream * concurrency)


def free_port() -> int:
    """A port for a server this starts: outside the range Ray's processes get theirs from."""
    from pagefleet.cluster.serve_env import free_ports

    return free_ports(1)[0]


def load() -> float:
    return round(os.getloadavg()[0], 2)


def checkpoint(model: str | None, simulate: str | None = None) -> str:
    """The checkpoint directory (the tokenizer the client counts with)."""
    if simulate is not None:
        from pagefleet.worker.simulated.checkpoint import simulated_checkpoint

        model = model or "llama-3-8b"
        return simulated_checkpoint(model) or model
    if model is not None:
        return model
    from pagefleet.cluster.demo.model import write_demo_checkpoint

    path = Path.home() / ".cache" / "pagefleet" / "bench-small-llama-fp32"
    if not (path / "config.json").is_file():
        write_demo_checkpoint(path, size="small", arch="llama", dtype="float32", seed=0)
    return str(path)


def emit(line: dict, out: Path | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(text + "\n")


# ---- servers --------------------------------------------------------------------------------


class Server:
    """A server process in a session of its own, stopped with SIGINT (then SIGKILL) as a user would."""

    def __init__(self, argv: list[str], base: str, log: Path, env: dict | None = None) -> None:
        self.base, self.log = base, log
        self.proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 900) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(f"{self.base}/v1/models", timeout=5).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"server not ready in {timeout_s} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_pagefleet(ckpt: str, workdir: Path, log_name: str = "pagefleet-serve", extra: list[str] = ()) -> Server:
    """``extra``: more `pagefleet serve` flags (``--simulate``, ``--workers``)."""
    port = free_port()
    argv = [str(BIN / "pagefleet"), "serve", "--model", ckpt, "--port", str(port),
            "--metrics-export-port", str(free_port()), "--log-stats-interval", "0", *extra]
    return Server(argv, f"http://127.0.0.1:{port}", workdir / f"{log_name}.log")


def serve_flags(args) -> list[str]:
    """The `pagefleet serve` flags of ``--simulate``, ``--workers``, ``--ingress-replicas`` and
    ``--stream-interval``."""
    flags = ["--workers", str(args.workers), "--ingress-replicas", str(getattr(args, "ingress_replicas", 1)),
             "--stream-interval", str(args.stream_interval)]
    if args.simulate:
        flags += ["--simulate", args.simulate, "--simulate-efficiency", str(args.simulate_efficiency)]
    return flags


def vllm_argv(venv: str, *args: str) -> list[str]:
    return [str(Path(venv) / "bin" / "python"), str(HERE / "_vllm_cli.py"), *args]


def start_vllm(venv: str, ckpt: str, workdir: Path, all_cores: bool = False) -> Server:
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if all_cores:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    argv = vllm_argv(venv, "serve", ckpt, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                     "--seed", "0")
    return Server(argv, f"http://127.0.0.1:{port}", workdir / f"vllm-serve{'-allcores' if all_cores else ''}.log",
                  env)


def bench(base: str, ckpt: str, concurrency: int, n: int, args, workdir: Path, tag: str,
          server_pid: int | None = None) -> dict:
    result = workdir / f"{tag}-c{concurrency}.json"
    argv = [str(BIN / "pagefleet"), "bench", "--base-url", base, "--tokenizer", ckpt, "--dataset", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--ignore-eos", "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--seed",
            str(concurrency), "--disable-tqdm", "--percentiles", "50,99", "--save-result", str(result)]
    cpu_before = tree_cpu_s(server_pid) if server_pid else {}
    # A simulated engine's step thread runs at the default priority: no compute threads to follow.
    engine = engine_threads_of(server_pid) if server_pid and not getattr(args, "simulate", None) else None
    sched_before = thread_sched(engine, LOWEST_NICE) if engine else {}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"pagefleet bench failed: {done.stderr[-2000:]}")
    r = json.loads(result.read_text())
    out = {"completed": r["completed"], "failed": r["failed"], "duration_s": round(r["duration"], 3),
           "output_tok_s": round(r["output_throughput"], 2), "ttft_p50_ms": round(r["median_ttft_ms"], 2),
           "ttft_p99_ms": round(r["p99_ttft_ms"], 2), "tpot_mean_ms": round(r["mean_tpot_ms"], 3),
           "itl_p50_ms": round(r["median_itl_ms"], 3)}
    # The client's CPU over the run, per output token: on this machine, cores the server did not get.
    if r["total_output_tokens"]:
        out["client_cpu_ms_per_token"] = round(1000 * r["client_cpu_s"] / r["total_output_tokens"], 3)
    if server_pid:  # the server's CPU per output token, by process role (the client's is apart, above)
        out["cpu_ms_per_token"] = per_token_ms(cpu_before, tree_cpu_s(server_pid), r["total_output_tokens"])
    if engine:
        out["engine_threads"] = sched_per_token(sched_before, thread_sched(engine, LOWEST_NICE),
                                                r["total_output_tokens"], r["duration"])
    return out


def engine_threads_of(server_pid: int) -> int | None:
    """The pid of a pagefleet server's worker replica, whose CPU engine computes on its threads at
    ``LOWEST_NICE`` (the engine thread and its OpenMP team); None for other servers."""
    return next((pid for pid in descendants(server_pid) if role_of(pid, default=None) == "worker"), None)


def warmed(system: str, server: Server, ckpt: str, args, workdir: Path) -> float:
    """Waits for the server, then sends it a few untimed requests (its first ones are slow);
    returns how long it took to become ready."""
    ready_s = server.wait_ready()
    bench(server.base, ckpt, 2, 4, args, workdir, f"{system}-warmup")
    return ready_s


def drive(system: str, server: Server, ckpt: str, args, workdir: Path, out: Path | None, info: dict) -> dict:
    ready_s = warmed(system, server, ckpt, args, workdir)
    lines = {}
    for c in args.concurrency:
        before = load()
        n = num_prompts(c, args.prompts_per_stream)
        line = {"system": system, "concurrency": c, "num_prompts": n,
                **bench(server.base, ckpt, c, n, args, workdir, system, server.proc.pid),
                "ready_s": round(ready_s, 1), "load_1m_before": before, "load_1m_after": load(), **info}
        emit(line, out)
        lines[c] = line
    return lines


def vllm_bench_client(venv: str, base: str, ckpt: str, workdir: Path) -> dict:
    """`vllm bench serve --model CKPT` against a running server, no other model flags."""
    result = workdir / "vllm-bench-client.json"
    argv = vllm_argv(venv, "bench", "serve", "--backend", "openai", "--base-url", base, "--endpoint",
                     "/v1/completions", "--model", ckpt, "--dataset-name", "random", "--random-input-len", "256",
                     "--random-output-len", "16", "--ignore-eos", "--num-prompts", "8", "--max-concurrency", "4",
                     "--save-result", "--result-dir", str(workdir), "--result-filename", result.name)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if done.returncode != 0 or not result.is_file():
        return {"completed": 0, "failed": 8, "error": (done.stderr or done.stdout)[-1500:]}
    r = json.loads(result.read_text())
    return {"completed": r["completed"], "failed": r.get("failed", 8 - r["completed"]), "num_prompts": 8}


def alone_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The engine alone's environment, as `pagefleet serve` gives its one worker replica (every
    core to one engine, as the engine alone computes): OMP_WAIT_POLICY=PASSIVE unless the user set
    one, and libgomp's spin where the served engine gets it, so both wait at their barriers alike."""
    env = {"OMP_WAIT_POLICY": "PASSIVE", **environ}
    cores = available_cores()
    return {**env, **compute_thread_env(cpu_compute_threads(None, cores), cores, environ)}


def engine_alone(ckpt: str, args, out: Path | None, info: dict, as_served: bool = False,
                 system: str | None = None) -> dict:
    """The engine alone's lines by concurrency (``_engine_alone.py`` in a process of its own).
    ``as_served``: its engine set up as a worker replica's (``_engine_alone.py --as-served``);
    ``system``: the name its lines carry (default: the script's)."""
    # N engines alone (fewer below C = N), each at C/N in flight: one runs, the others alike
    engines = [min(getattr(args, "workers", 1), c) for c in args.concurrency]
    plan = [f"{c // k}:{max(num_prompts(c, args.prompts_per_stream) // k, 1)}"
            for c, k in zip(args.concurrency, engines)]
    before = load()
    simulated = getattr(args, "simulate", None)
    simulate = ["--simulate", f"{simulated}:{args.simulate_efficiency}"] if simulated else []
    model = args.model or "llama-3-8b" if simulated else ckpt
    done = subprocess.run([sys.executable, str(HERE / "_engine_alone.py"), *(["--as-served"] if as_served else []),
                           *simulate, model, str(args.input_len), str(args.output_len), *plan],
                          capture_output=True, text=True, timeout=3600, env=alone_env())
    if done.returncode != 0:
        raise RuntimeError(f"engine-alone failed: {done.stderr[-2000:]}")
    lines = {}
    texts = [text for text in done.stdout.splitlines() if text.startswith("{")]
    for text, k in zip(texts, engines, strict=True):
        line = {**json.loads(text), **({"system": system} if system else {}), "load_1m_before": before,
                "load_1m_after": load(), **info}
        if k > 1:  # the k engines' together, at the concurrency the server had
            line.update(engines=k, concurrency=line["concurrency"] * k, output_tok_s=round(line["output_tok_s"] * k, 2))
        emit(line, out)
        lines[line["concurrency"]] = line
    return lines


def overhead(c: int, engine: dict, served: dict, peers: dict[str, dict]) -> dict:
    """``peers``: the other servers' lines at this concurrency, by system name."""
    line = {"summary": "ray_path_overhead", "concurrency": c,
            "ttft_p50_added_ms": round(served["ttft_p50_ms"] - engine["ttft_p50_ms"], 2),
            "tpot_added_ms": round(served["tpot_mean_ms"] - engine["tpot_mean_ms"], 3),
            "tok_s_vs_engine": round(served["output_tok_s"] / engine["output_tok_s"], 3)}
    if "cpu_ms_per_token" in served:
        # Every process of the server but the worker replica's (the ingress, HAProxy, Serve's
        # controller, the global scheduler, Ray's own): CPU the engine's cores lose to the path,
        # a lower bound (the replica's own event loop and delta channel are in the worker's).
        line["outside_worker_cpu_ms_per_token"] = round(
            sum(ms for role, ms in served["cpu_ms_per_token"].items() if role != "worker"), 3)
    client_ms = served.get("client_cpu_ms_per_token")
    if client_ms is not None:
        # `pagefleet bench`'s own CPU over the run: on this machine it computes on the engine's cores,
        # which the engine alone (driven in its own process, no client) has to itself.
        line["client_cpu_ms_per_token"] = client_ms
    if "cpu_ms_per_token" in served and "cpu_ms_per_token" in engine and not libgomp_spins(alone_env()):
        # The server's CPU per token (every process of it) beyond what the engine alone spends:
        # the Ray path's cost in CPU, which on a CPU-bound machine caps tok/s at
        # engine / (engine + path) of the engine's. Not where the OpenMP team spins: its waits
        # count as CPU then, and an engine that is preempted more spins less.
        engine_ms = engine["cpu_ms_per_token"]["engine"]
        served_ms = sum(served["cpu_ms_per_token"].values())
        line["engine_alone_cpu_ms_per_token"] = engine_ms
        line["served_cpu_ms_per_token"] = round(served_ms, 3)
        line["path_cpu_ms_per_token"] = round(served_ms - engine_ms, 3)
        line["cpu_bound_tok_s_ceiling_vs_engine"] = round(engine_ms / served_ms, 3)
        if client_ms is not None:  # the client on the same cores too (a user's is elsewhere)
            line["cpu_bound_tok_s_ceiling_with_client_vs_engine"] = round(engine_ms / (served_ms + client_ms), 3)
    if "engine_threads" in served and "engine_threads" in engine:
        # The engine's compute threads, runnable but not running: on a machine whose cores the
        # engine fills, a wake-up of another thread preempts one of them (the served engine
        # computes at the lowest priority) and its partners wait for it at the barrier. The
        # engine alone counts every thread of its process (the idle ones add nothing), unpinned
        # at niceness 0 as LLMEngine runs; served, the threads at LOWEST_NICE, pinned.
        alone, there = engine["engine_threads"], served["engine_threads"]
        line["engine_runqueue_wait_ms_per_token_added"] = round(
            there["runqueue_wait_ms_per_token"] - alone["runqueue_wait_ms_per_token"], 3)
        line["engine_involuntary_switches_per_s"] = {"engine_alone": alone["involuntary_switches_per_s"],
                                                     "served": there["involuntary_switches_per_s"]}
    for name, peer in peers.items():
        line[f"tok_s_vs_{name.replace('-', '_')}"] = round(served["output_tok_s"] / peer["output_tok_s"], 3)
    return line


def run_round(order: list[str], ckpt: str, args, workdir: Path, info: dict, have_vllm: bool,
              check_client: bool) -> dict[str, dict]:
    """Each system of ``order`` once, one after the other: its lines by concurrency, by system."""
    results: dict[str, dict] = {}
    for name in order:
        if name == "engine-alone":
            results[name] = engine_alone(ckpt, args, args.out, info)
        elif name == "pagefleet-serve":
            server = start_pagefleet(args.model or "llama-3-8b" if args.simulate else ckpt, workdir,
                                     extra=serve_flags(args))
            try:
                results[name] = drive(name, server, ckpt, args, workdir, args.out, info)
                if have_vllm and check_client:
                    emit({"check": "vllm_bench_serve_against_pagefleet", "model_flag": ckpt,
                          **vllm_bench_client(args.vllm_venv, server.base, ckpt, workdir)}, args.out)
            finally:
                server.stop()
        elif have_vllm:
            server = start_vllm(args.vllm_venv, ckpt, workdir, all_cores=name.endswith("allcores"))
            try:
                results[name] = drive(name, server, ckpt, args, workdir, args.out, info)
            finally:
                server.stop()
    return results


def round_overhead(c: int, results: dict[str, dict]) -> dict | None:
    """The overhead line at concurrency ``c`` from one round's results (None without both the
    engine alone and pagefleet serve), against whichever vLLM servers ran in that round."""
    if "engine-alone" not in results or "pagefleet-serve" not in results:
        return None
    peers = {name: results[name][c] for name in ("vllm-serve", "vllm-serve-allcores") if c in results.get(name, {})}
    return overhead(c, results["engine-alone"][c], results["pagefleet-serve"][c], peers)


# The overhead figures whose median over rounds the last lines give.
MEDIAN_KEYS = ("ttft_p50_added_ms", "tpot_added_ms", "tok_s_vs_engine", "tok_s_vs_vllm_serve",
               "tok_s_vs_vllm_serve_allcores", "path_cpu_ms_per_token", "outside_worker_cpu_ms_per_token",
               "client_cpu_ms_per_token")


def median_overhead(c: int, per_round: list[dict[str, dict]]) -> dict | None:
    """Per overhead figure at concurrency ``c``: its value in each round (each round's systems ran
    minutes apart, the rounds further apart) and their median. On a shared machine whose speed
    drifts by a quarter within the hour, a ratio taken within a round is what compares; the median
    over rounds is the run's figure."""
    lines = [line for line in (round_overhead(c, results) for results in per_round) if line is not None]
    if not lines:
        return None
    out: dict = {"summary": "ray_path_overhead_median", "concurrency": c, "rounds": len(lines)}
    for key in MEDIAN_KEYS:
        values = [line[key] for line in lines if key in line]
        if values:
            out[key] = {"median": round(statistics.median(values), 3), "rounds": values}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the random-weight 512x8 Llama)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vllm-venv", default=DEFAULT_VLLM_VENV, help="venv with vllm-cpu (skipped when absent)")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    p.add_argument("--rounds", type=int, default=3,
                   help="measure every system this many times, in alternating order; the last lines give "
                        "the median over rounds of each overhead figure")
    p.add_argument("--label", default=None, help="a note carried in every line (e.g. the commit measured)")
    p.add_argument("--simulate", default=None, metavar="GPU",
                   help="the simulated GPU engine on both sides (docs/simulator.md); --model then defaults to "
                        "llama-3-8b")
    p.add_argument("--simulate-efficiency", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=1, help="pagefleet serve's worker replicas")
    p.add_argument("--ingress-replicas", type=int, default=1, help="pagefleet serve's OpenAI ingress replicas")
    p.add_argument("--stream-interval", type=int, default=1, help="pagefleet serve's tokens per streamed chunk")
    p.add_argument("--prompts-per-stream", type=int, default=3,
                   help="requests each of the C client streams sends (more: fixed costs weigh less per token)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.workers < 1 or any(c % args.workers for c in args.concurrency if c >= args.workers):
        p.error("--workers must be >= 1 and divide each concurrency it is not above")
    ckpt = checkpoint(args.model, args.simulate)
    info = {"machine": machine(), "input_len": args.input_len, "output_len": args.output_len,
            **({"simulate": args.simulate, "simulate_efficiency": args.simulate_efficiency} if args.simulate else {}),
            **({"workers": args.workers} if args.workers > 1 else {}),
            **({"ingress_replicas": args.ingress_replicas} if args.ingress_replicas > 1 else {}),
            **({"stream_interval": args.stream_interval} if args.stream_interval > 1 else {}),
            **({"label": args.label} if args.label else {})}
    have_vllm = (Path(args.vllm_venv) / "bin" / "python").is_file()
    workdir = Path(tempfile.mkdtemp(prefix="pf-serving-bench-"))
    per_round: list[dict[str, dict]] = []
    for r in range(args.rounds):
        # Odd rounds run the systems in reverse order, so no system always runs in the same part of
        # a drifting machine's run.
        order = args.systems if r % 2 == 0 else args.systems[::-1]
        results = run_round(order, ckpt, args, workdir, {**info, "round": r}, have_vllm, check_client=r == 0)
        per_round.append(results)
        for c in args.concurrency:
            line = round_overhead(c, results)
            if line is not None:
                emit({**line, "round": r, "label": args.label}, args.out)
    if args.rounds > 1:
        for c in args.concurrency:
            line = median_overhead(c, per_round)
            if line:
                emit({**line, "label": args.label}, args.out)
    print(f"logs and raw results: {workdir}", file=sys.stderr)


if __name__ == "__main__":
    main()
