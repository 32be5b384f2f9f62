"""One runner per system for offline_throughput.py; each runs in its own process.

Every runner gets the same workload (prompt token ids and exact output
lengths), does one untimed warm-up request, then times only the generation of
the whole workload (model loading, compilation and cache allocation are outside
the clock; pagefleet reports its start-up separately, and then times one
single-stream request).
`output_tokens` counts only the tokens the workload asked for; systems that
must generate more (static batching pads every request to its batch's longest
output) report the extra work as `generated_tokens`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from _proc_rss import tree_peak_rss_mib  # noqa: F401  (re-exported for offline_throughput.py)

BLOCK_SIZE = 16
# vLLM's CPU defaults: 4096-token steps keep two cores' matmuls busy.
MAX_NUM_SEQS = 256
MAX_BATCH_TOKENS = 4096


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]  # prompt token ids, one list per request
    output_lens: list[int]  # exact number of output tokens per request (ignore_eos)
    single_prompt: list[int]  # the single-stream request, timed alone after the workload
    single_output_len: int


@dataclass(slots=True)
class RunResult:
    output_tokens: int  # tokens the workload asked for
    generated_tokens: int  # tokens the system actually generated (>= output_tokens)
    wall_s: float
    note: str | None = None
    extra: dict | None = None  # system-specific figures, copied into the result line
    startup_s: float | None = None  # engine construction, compilation included
    single_stream_wall_s: float | None = None  # the single-stream request alone


def kv_bytes_for(workload: Workload, config: dict, dtype_bytes: int) -> int:
    """KV bytes that hold every request of the workload at once, whole blocks each."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes
    blocks = sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in zip(workload.prompts, workload.output_lens))
    # One spare block per request: the last token's KV is written a step early.
    return (blocks + len(workload.prompts)) * BLOCK_SIZE * per_token


def max_len_for(workload: Workload) -> int:
    """The longest request: the engine refuses a KV pool smaller than max_model_len, and the pool
    here holds exactly the workload."""
    return max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))


def run_pagefleet(ckpt: str, workload: Workload, config: dict, enforce_eager: bool,
                  cpu_omp_threads: int | None) -> RunResult:
    from pagefleet.worker import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=ckpt, dtype="float32", device="cpu", block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_BATCH_TOKENS, kv_cache_bytes=kv_bytes_for(workload, config, 4),
              max_model_len=max_len_for(workload), enforce_eager=enforce_eager, cpu_omp_threads=cpu_omp_threads)
    startup = time.perf_counter() - start
    llm.generate([{"prompt_token_ids": workload.prompts[0][:16]}],
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    prompts = [{"prompt_token_ids": ids} for ids in workload.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    lengths = [len(out.outputs[0].token_ids) for out in outputs]
    if lengths != workload.output_lens:
        raise RuntimeError("pagefleet did not generate the exact output lengths asked for")
    start = time.perf_counter()
    one = llm.generate([{"prompt_token_ids": workload.single_prompt}],
                       SamplingParams(temperature=0.0, max_tokens=workload.single_output_len, ignore_eos=True))
    single = time.perf_counter() - start
    if len(one[0].outputs[0].token_ids) != workload.single_output_len:
        raise RuntimeError("pagefleet's single-stream request came back short")
    return RunResult(sum(lengths), sum(lengths), wall, startup_s=startup, single_stream_wall_s=single,
                     extra={"torch_threads": torch.get_num_threads()})


def run_pagefleet_serving(ckpt: str, workload: Workload, config: dict, metrics: bool) -> RunResult:
    """The serving path: ``AsyncLLMEngine`` (engine thread, per-request streams) in a process with a
    local Ray, as in a worker replica; ``metrics`` records the engine metrics with ``ray.util.metrics``
    exactly as a replica does. Both variants start Ray, so the difference is the metrics alone."""
    import asyncio

    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams
    from pagefleet.worker.metrics.recorder import RayEngineMetricsRecorder

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    def recorder(cfg):
        return RayEngineMetricsRecorder(cfg.served_model_name, "bench", cfg.max_model_len)

    engine = AsyncLLMEngine(EngineArgs(model=ckpt, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                                       max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCH_TOKENS,
                                       kv_cache_bytes=kv_bytes_for(workload, config, 4),
                                       max_model_len=max_len_for(workload)),
                            metrics=recorder if metrics else None)

    async def one(rid: str, ids: list[int], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        count = 0
        async for delta in engine.generate(rid, ids, params):
            count += sum(len(s.token_ids) for s in delta.sequences)
        return count

    async def run_all() -> list[int]:
        return await asyncio.gather(*(one(f"r{i}", ids, n) for i, (ids, n) in
                                      enumerate(zip(workload.prompts, workload.output_lens))))

    # Time spent in the engine thread's metrics hooks (collecting and recording), measured
    # directly: on a shared machine this is steadier than a throughput difference.
    hooks_s = [0.0]
    observer = engine._metrics  # the loop's EngineMetrics; wrapped here, for this measurement only
    for name in ("request_added", "after_step", "after_abort", "idle"):
        def timed(*a, _f=getattr(observer, name), **kw):
            t = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                hooks_s[0] += time.perf_counter() - t
        setattr(observer, name, timed)
    try:
        asyncio.run(one("warmup", workload.prompts[0][:16], 2))
        hooks_s[0] = 0.0
        start, cpu = time.perf_counter(), time.process_time()
        lengths = asyncio.run(run_all())
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        engine.shutdown()
        ray.shutdown()
    if lengths != workload.output_lens:
        raise RuntimeError("pagefleet did not generate the exact output lengths asked for")
    return RunResult(sum(lengths), sum(lengths), wall, extra={
        "cpu_s": round(cpu, 3), "output_tokens_per_cpu_s": round(sum(lengths) / cpu, 2),
        "metrics_hooks_s": round(hooks_s[0], 4), "metrics_hooks_share_of_wall": round(hooks_s[0] / wall, 5)})


def _load_hf_model(ckpt: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.eval()
    return model


def run_hf_static(ckpt: str, workload: Workload, batch_size: int) -> RunResult:
    """`generate` over consecutive batches in workload order, prompts left-padded.

    Static batching cannot stop a request early: each batch runs until its
    longest requested output (min_new_tokens = max_new_tokens = that length)."""
    from transformers import GenerationConfig

    model = _load_hf_model(ckpt)
    pad_id = model.config.pad_token_id

    def generate(prompts: list[list[int]], num_new: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        config = GenerationConfig(do_sample=False, max_new_tokens=num_new, min_new_tokens=num_new,
                                  pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        return out[:, width:]

    generate([workload.prompts[0][:16]], 2)
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        lens = workload.output_lens[first:first + batch_size]
        new_tokens = generate(workload.prompts[first:first + batch_size], max(lens))
        if new_tokens.shape[1] != max(lens):
            raise RuntimeError(f"generate returned {new_tokens.shape[1]} new tokens, expected {max(lens)}")
        generated += new_tokens.numel()
    wall = time.perf_counter() - start
    return RunResult(sum(workload.output_lens), generated, wall,
                     note="static batching generates every request of a batch to the batch's longest output; "
                          "only the requested tokens count as output_tokens")


def run_hf_continuous(ckpt: str, workload: Workload) -> RunResult:
    """transformers' continuous batching, with each request's own max_new_tokens.

    `generate_batch` takes one max_new_tokens for all requests, so this drives
    the same manager that `generate_batch` wraps (continuous_batching_context_manager
    + add_request per request), which accepts a per-request length. The KV
    cache is sized for the whole workload and the token budget matches
    pagefleet's, since on CPU transformers would otherwise size its cache from
    all of host memory."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _load_hf_model(ckpt)
    page_size = 256
    pages = sum(-(-(len(p) + n) // page_size) for p, n in zip(workload.prompts, workload.output_lens))
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=pages + len(workload.prompts),
                                         max_batch_tokens=MAX_BATCH_TOKENS, max_requests_per_batch=MAX_NUM_SEQS)
    # eos -1: transformers' "no EOS", i.e. ignore_eos.
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1,
                                  pad_token_id=model.config.pad_token_id)
    with model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=30,
                                                   continuous_batching_config=cb_config) as manager:
        _collect(manager, [manager.add_request(workload.prompts[0][:16], max_new_tokens=2, eos_token_id=-1)])
        start = time.perf_counter()
        request_ids = [manager.add_request(ids, max_new_tokens=n, eos_token_id=-1)
                       for ids, n in zip(workload.prompts, workload.output_lens)]
        results = _collect(manager, request_ids)
        wall = time.perf_counter() - start
    lengths = [len(results[rid].generated_tokens) for rid in request_ids]
    if lengths != workload.output_lens:
        raise RuntimeError("transformers continuous batching did not generate the exact output lengths asked for")
    return RunResult(sum(lengths), sum(lengths), wall,
                     note="per-request max_new_tokens through the manager that generate_batch wraps")


def _collect(manager, request_ids: list[str]) -> dict:
    """Wait until every request is finished; raise if one failed or the loop died."""
    pending, results = set(request_ids), {}
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped with requests pending")
            continue
        if result.request_id in pending and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            pending.discard(result.request_id)
            results[result.request_id] = result
    return results
