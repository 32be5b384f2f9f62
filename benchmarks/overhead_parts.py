"""Which part of the Ray path's overhead is which: the served engine's set-up, the idle cluster
beside it, and the requests' own path, measured in one round each.

serving.py gives `pagefleet serve`'s figures over the engine alone's. This splits that overhead
into three steps, each one change from the system before it, all on serving.py's checkpoint and
workload (random prompts of 256 tokens, 64 output tokens, EOS ignored):

  engine-alone          serving.py's engine alone: LLMEngine in a process of its own, at
                        niceness 0, its threads unpinned, as a user's script runs it
  engine-as-served      the same engine set up as a worker replica sets up its own
                        (``_engine_alone.py --as-served``): built and stepped on a thread at
                        the lowest priority whose OpenMP team is pinned, one thread per core
  engine-beside-idle-ray-serve  engine-as-served again beside a bare Ray Serve app (``_bare_serve.py``:
                        the local cluster started as `pagefleet serve` starts it, an ingress
                        deployment holding a handle to a second one, one replica each, warmed, then
                        sent nothing): what Ray and Serve alone cost, with none of pagefleet's
                        processes or code (no global scheduler actor, no engine in the cluster)
  engine-beside-idle-serve  engine-as-served again while an idle `pagefleet serve` (started and
                        warmed, then sent nothing) runs beside it: everything a served engine
                        shares its cores with when no request is in flight (Ray's GCS, raylet and
                        agents, Serve's controller, proxy and HAProxy, the ingress and scheduler
                        actors, and the worker replica's own idle process and engine)
  pagefleet-serve       serving.py's served system: the same cluster, now carrying the requests

Per round and concurrency, one ``overhead_parts`` line. For each of TTFT p50 and TPOT, the
milliseconds each step adds (``setup``: as-served over alone; ``ray_serve_idle``: beside the
bare app over as-served; ``pagefleet_idle``: beside the idle `pagefleet serve` over beside the bare
app; ``request_path``: served over beside the idle `pagefleet serve`; they sum to served over
alone); for output tok/s, each step's ratio (their product is served over alone); and each idle
server's CPU (its whole process tree, ms a second over ``IDLE_WINDOW_S``, before the engine beside
it starts). The last lines give each figure's value in every round and the median. As in
serving.py, the systems run in reverse order every other round, and a figure is only taken
between runs of one round.

    python benchmarks/overhead_parts.py                          # c1 and c16, 3 rounds
    python benchmarks/overhead_parts.py --rounds 1 --concurrency 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

import serving
from _machine import machine
from _proc_cpu import tree_cpu_s

SYSTEMS = ("engine-alone", "engine-as-served", "engine-beside-idle-ray-serve", "engine-beside-idle-serve",
           "pagefleet-serve")
# (step name, system measured after the step, system before it)
STEPS = (("setup", "engine-as-served", "engine-alone"),
         ("ray_serve_idle", "engine-beside-idle-ray-serve", "engine-as-served"),
         ("pagefleet_idle", "engine-beside-idle-serve", "engine-beside-idle-ray-serve"),
         ("request_path", "pagefleet-serve", "engine-beside-idle-serve"))
IDLE_SYSTEMS = ("engine-beside-idle-ray-serve", "engine-beside-idle-serve")
# How long a warmed server is left alone before its idle CPU is measured: its last requests'
# aftermath (metrics pushes, the scheduler's updates) is over by then.
SETTLE_S = 5.0
# How long an idle server's CPU is measured before the engine beside it runs.
IDLE_WINDOW_S = 10.0


def run_system(name: str, ckpt: str, args, workdir: Path, info: dict) -> dict:
    """One system's lines by concurrency."""
    if name == "engine-alone":
        return serving.engine_alone(ckpt, args, args.out, info)
    if name == "engine-as-served":
        return serving.engine_alone(ckpt, args, args.out, info, as_served=True)
    if name == "engine-beside-idle-ray-serve":
        port = serving.free_port()
        server = serving.Server([sys.executable, str(serving.HERE / "_bare_serve.py"), str(port)],
                                f"http://127.0.0.1:{port}", workdir / f"{name}.log")
    else:
        server = serving.start_pagefleet(ckpt, workdir, log_name=name)
    try:
        if name == "pagefleet-serve":
            return serving.drive(name, server, ckpt, args, workdir, args.out, info)
        if name == "engine-beside-idle-ray-serve":
            server.wait_ready()
            for _ in range(4):  # a few calls through the ingress and its handle, as the warm-up sends
                httpx.get(f"{server.base}/v1/models", timeout=30).raise_for_status()
        else:
            serving.warmed(name, server, ckpt, args, workdir)
        time.sleep(SETTLE_S)
        idle = idle_cpu_ms_per_s(server.proc.pid, IDLE_WINDOW_S)
        return serving.engine_alone(ckpt, args, args.out, {**info, "idle_server_cpu_ms_per_s": idle},
                                    as_served=True, system=name)
    finally:
        server.stop()


def idle_cpu_ms_per_s(root: int, window_s: float) -> dict[str, float]:
    """CPU a second of ``root``'s process tree over ``window_s``, by role and in all (``total``)."""
    before, started = tree_cpu_s(root), time.monotonic()
    time.sleep(window_s)
    after, elapsed = tree_cpu_s(root), time.monotonic() - started
    by_role = {role: round(1000 * (after[role] - before.get(role, 0.0)) / elapsed, 1) for role in sorted(after)}
    return {**by_role, "total": round(sum(by_role.values()), 1)}


def parts(c: int, results: dict[str, dict]) -> dict:
    """The ``overhead_parts`` line at concurrency ``c`` from one round's results."""
    line: dict = {"summary": "overhead_parts", "concurrency": c}
    alone, served = results["engine-alone"][c], results["pagefleet-serve"][c]
    for metric, key in (("ttft_p50_ms", "ttft_p50_added_ms"), ("tpot_mean_ms", "tpot_added_ms")):
        line[key] = {step: round(results[after][c][metric] - results[before][c][metric], 3)
                     for step, after, before in STEPS}
        line[key]["total"] = round(served[metric] - alone[metric], 3)
    line["tok_s_ratio"] = {step: round(results[after][c]["output_tok_s"] / results[before][c]["output_tok_s"], 3)
                           for step, after, before in STEPS}
    line["tok_s_ratio"]["total"] = round(served["output_tok_s"] / alone["output_tok_s"], 3)
    line["idle_server_cpu_ms_per_s"] = {name: results[name][c]["idle_server_cpu_ms_per_s"]["total"]
                                        for name in IDLE_SYSTEMS}
    return line


def medians(c: int, lines: list[dict]) -> dict:
    """Each figure's value in every round and their median."""
    out: dict = {"summary": "overhead_parts_median", "concurrency": c, "rounds": len(lines)}
    for key in ("ttft_p50_added_ms", "tpot_added_ms", "tok_s_ratio", "idle_server_cpu_ms_per_s"):
        out[key] = {}
        for step in lines[0][key]:
            values = [line[key][step] for line in lines]
            out[key][step] = {"median": round(statistics.median(values), 3), "rounds": values}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: serving.py's)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    p.add_argument("--label", default=None, help="a note carried in every line (e.g. the commit measured)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    ckpt = serving.checkpoint(args.model)
    info = {"machine": machine(), "input_len": args.input_len, "output_len": args.output_len,
            **({"label": args.label} if args.label else {})}
    workdir = Path(tempfile.mkdtemp(prefix="pf-overhead-parts-"))
    per_round: dict[int, list[dict]] = {c: [] for c in args.concurrency}
    for r in range(args.rounds):
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        results = {name: run_system(name, ckpt, args, workdir, {**info, "round": r}) for name in order}
        for c in args.concurrency:
            line = parts(c, results)
            per_round[c].append(line)
            serving.emit({**line, "round": r, **info}, args.out)
    if args.rounds > 1:
        for c in args.concurrency:
            serving.emit({**medians(c, per_round[c]), **info}, args.out)
    print(f"logs and raw results: {workdir}", file=sys.stderr)


if __name__ == "__main__":
    main()
