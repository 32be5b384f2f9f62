"""lm-eval against `pagefleet serve`: its `local-completions` model (echo + logprobs over HTTP)
and its `hf` model (transformers in process) on the same checkpoint and the same local task;
prints one JSON line with both accuracies and how far apart each sample's loglikelihoods are.

lm-eval runs from a venv of its own (`--lm-eval-venv`, made by `--setup`), not a test dependency.
The task (`evals/local_mc/`) is a file beside this script: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _machine import machine_with_load
from serving import checkpoint, emit, start_pagefleet

HERE = Path(__file__).resolve().parent
TASK_DIR = HERE / "evals" / "local_mc"
TASK = "pagefleet_local_mc"
DEFAULT_VENV = HERE / ".venv-lm-eval"
# The CPU wheel: an unpinned torch would pull a multi-GB CUDA build into the venv.
SETUP_PACKAGES = ["torch==2.13.0", "lm-eval[api,hf]==0.4.13", "transformers==5.25.0", "accelerate"]


def setup(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *SETUP_PACKAGES], check=True)


def task_dir(workdir: Path) -> Path:
    """The task with its data file's absolute path (lm-eval reads it relative to the cwd)."""
    out = workdir / "task"
    out.mkdir()
    text = (TASK_DIR / "local_mc.yaml").read_text()
    (out / "local_mc.yaml").write_text(text.replace("test: test.jsonl", f"test: {TASK_DIR / 'test.jsonl'}"))
    return out


def lm_eval(venv: Path, model: str, model_args: str, tasks: Path, out: Path) -> Path:
    subprocess.run([str(venv / "bin" / "lm_eval"), "--model", model, "--model_args", model_args,
                    "--tasks", TASK, "--include_path", str(tasks), "--log_samples", "--output_path", str(out),
                    "--batch_size", "1", "--seed", "0", "--device", "cpu"], check=True)
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    return samples


def read_samples(path: Path) -> dict[int, tuple[list[float], float]]:
    """doc id -> (each choice's loglikelihood, the sample's acc)."""
    out = {}
    for line in path.read_text().splitlines():
        s = json.loads(line)
        out[s["doc_id"]] = ([float(r[0]) for r in s["filtered_resps"]], float(s["acc"]))
    return out


def compare(hf: dict, served: dict) -> dict:
    if hf.keys() != served.keys():
        raise RuntimeError(f"the two runs scored different documents: {sorted(hf)} vs {sorted(served)}")
    diffs = [abs(a - b) for d in hf for a, b in zip(hf[d][0], served[d][0], strict=True)]
    return {"documents": len(hf), "loglikelihoods": len(diffs), "max_abs_diff": max(diffs),
            "mean_abs_diff": sum(diffs) / len(diffs),
            "acc_hf": sum(a for _, a in hf.values()) / len(hf),
            "acc_pagefleet": sum(a for _, a in served.values()) / len(served),
            "same_choice_every_document": all(hf[d][1] == served[d][1] for d in hf)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the small demo Llama, fp32)")
    parser.add_argument("--lm-eval-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--setup", action="store_true", help="make the lm-eval venv first")
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    if args.setup:
        setup(args.lm_eval_venv)
    ckpt = checkpoint(args.model)
    with tempfile.TemporaryDirectory(prefix="pagefleet-lm-eval-") as tmp:
        workdir = Path(tmp)
        tasks = task_dir(workdir)
        hf = read_samples(lm_eval(args.lm_eval_venv, "hf", f"pretrained={ckpt},dtype=float32", tasks,
                                  workdir / "hf"))
        server = start_pagefleet(ckpt, workdir, extra=["--dtype", "float32"])
        try:
            server.wait_ready()
            import httpx

            name = httpx.get(f"{server.base}/v1/models", timeout=30).json()["data"][0]["id"]
            served = read_samples(lm_eval(
                args.lm_eval_venv, "local-completions",
                f"model={name},base_url={server.base}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={ckpt},num_concurrent=4,max_retries=1", tasks, workdir / "served"))
        finally:
            server.stop()
    emit({"benchmark": "lm_eval_compare", "task": TASK, "checkpoint": ckpt, **compare(hf, served),
          "machine": machine_with_load()}, args.out)


if __name__ == "__main__":
    main()
