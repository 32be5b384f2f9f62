"""The GPU check's engine section: a random-weight Llama-3-8B-shaped model as five engines (bf16
with CUDA graphs, the same with greedy windows of 8 decode steps, FP8 weights, FP8 KV cache,
bf16 eager), each measured for single-stream decode, the TTFT of a 512-token prompt and offline
throughput against the memory-bandwidth roofline, and for next-token logits against the first's.
The first engine sizes its KV pool from device memory, replays its graphs against the same
forward run eagerly, and profiles where a decode step's time goes (device kernel time against
wall time, kernel launches); the FP8-weight one profiles its decode steps too.
Run through gpu_check.py, which passes its ``Run`` (device, peak bandwidth, time budget, emit)."""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=512, max_position_embeddings=8192)


def write_checkpoint_config(path: Path, shape: dict) -> None:
    """config.json (load_format="dummy" needs no weights) plus a word-level tokenizer covering the vocabulary.

    Generation runs on token ids; the tokenizer only has to map every id to
    some text, and a word-level one loads in a second where a trained BPE with
    128k entries takes tens.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
                  rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, dtype="bfloat16", hidden_act="silu")
    config.update(shape)  # another architecture's shape names its own
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", unk_token="w0").save_pretrained(
        path)


# The engines the check compares, each a set of LLM options over the same random weights:
# (name, options, the throughput batches it runs).
VARIANTS = [
    ("bf16, CUDA graphs", {}, (64, 256)),  # async scheduling on, the default
    ("bf16, CUDA graphs, no async scheduling", {"async_scheduling": False}, (64, 256)),
    ("bf16, greedy windows of 8", {"num_scheduler_steps": 8}, (64, 256)),
    ("fp8 weights", {"quantization": "fp8"}, (64, 256)),
    ("fp8 KV cache", {"kv_cache_dtype": "fp8"}, (64, 256)),
    ("bf16, eager", {"enforce_eager": True}, (64,)),  # last: the slowest, and what matters least
]


def check_engine(run) -> None:  # run: gpu_check.Run
    """Every variant: start-up (KV pool, graphs), next-token logits on a fixed prompt set against
    the first variant's (cosine similarity, greedy agreement), single-stream decode, the TTFT of
    one 512-token prompt, offline throughput; the first also graph replay against the same
    forward run eagerly, and a profile of its decode steps."""
    tiny = run.dry_run
    shape = TINY if tiny else LLAMA3_8B
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint_config(Path(tmp), shape)
        reference = None
        for name, options, batches in VARIANTS:
            if run.out_of_time():
                run.emit("skipped", what=f"engine {name}", reason="time budget")
                continue
            try:
                reference = _check_variant(run, tmp, shape, name, options, batches, reference)
            except Exception as e:  # one variant's failure must not hide the others'
                run.emit("error", section=f"engine {name}", error=f"{type(e).__name__}: {e}"[:2000])
            gc.collect()
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
                run.emit("engine_released", variant=name,
                         allocated_bytes_after=torch.cuda.memory_allocated(run.device))


def _check_variant(run, tmp: str, shape: dict, name: str, options: dict, batches: tuple, reference):
    from pagefleet.worker import LLM, SamplingParams

    tiny = run.dry_run
    prompt_len, output_len = (8, 4) if tiny else (128, 256)
    single_prompt, single_output = (8, 6) if tiny else (128, 128)
    batches = (4,) if tiny else batches
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_elem = 1 if options.get("kv_cache_dtype") == "fp8" else 2
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * kv_elem
    first = reference is None
    t0 = time.monotonic()
    kwargs = dict(model=tmp, load_format="dummy", dtype="bfloat16", device=run.device.type, block_size=16,
                  max_num_batched_tokens=8192 if not tiny else 256, enable_prefix_caching=False,
                  max_model_len=1024 if not tiny else 64, **options)
    if tiny:
        # The CPU engine's compiled kernels plan attention on the host, which a graph cannot:
        # the dry run takes the twins, and the graph variant their static-buffer path uncaptured.
        kwargs.update(max_num_seqs=4, kv_cache_bytes=(4 * 64 + 64) * kv_per_token, enforce_eager=True)
        kwargs.setdefault("async_output_proc", True)  # as on CUDA, so async scheduling runs as it would there
    elif not first:
        # The first engine sizes its pool from device memory (the default); the others take a
        # fixed pool that holds the largest batch, so they start fast.
        kwargs["kv_cache_bytes"] = (max(batches) * (prompt_len + output_len) + 4096) * kv_per_token
    llm = LLM(**kwargs)
    startup_s = time.monotonic() - t0
    runner = llm.engine.executor.runner
    if tiny and not options.get("enforce_eager"):
        runner.use_graphs(capture=False)  # CPU: the static-buffer path the GPU captures
    model = runner.model
    graphs = runner.decode_graphs
    weight_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                       if t is not model.cos_sin)
    step_weight_bytes = weight_bytes - model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    pool = llm.engine.pool
    run.emit("engine_setup", variant=name, options=options,
             model="Llama-3-8B-shaped, random weights" if not tiny else "tiny llama",
             weight_bytes=weight_bytes, decode_step_weight_bytes=step_weight_bytes, startup_s=round(startup_s, 1),
             kernels=str(model.kernels), max_num_seqs=llm.engine.args.max_num_seqs,
             async_output=llm.engine.async_output, async_scheduling=llm.engine.async_scheduling,
             kv_pool_blocks=pool.num_blocks, kv_pool_bytes=pool.num_blocks * runner.kv_bytes_per_block(16),
             kv_pool_sized_by="profile run" if "kv_cache_bytes" not in kwargs else "kv_cache_bytes",
             decode_graphs=len(graphs.graphs) if graphs else 0,
             prefill_graphs=len(runner.prefill_graphs.graphs) if graphs else 0,
             graph_capture_s=round(graphs.capture_s + runner.prefill_graphs.capture_s, 2) if graphs else None,
             graph_pool_bytes=graphs.pool_bytes + runner.prefill_graphs.pool_bytes if graphs else None)

    gen = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    logits = _prompt_logits(runner, [torch.randint(10, vocab, (16 if tiny else 64,), generator=gen).tolist()
                                     for _ in range(2 if tiny else 8)])
    if reference is None:
        reference = logits
    else:
        cos = torch.nn.functional.cosine_similarity(logits.double(), reference.double(), dim=-1)
        run.emit("engine_logits_vs_bf16", variant=name, positions=int(cos.numel()),
                 cosine_min=round(float(cos.min()), 5), cosine_mean=round(float(cos.mean()), 5),
                 greedy_agreement=round(float((logits.argmax(-1) == reference.argmax(-1)).double().mean()), 4),
                 note="random weights: greedy agreement is a weak signal")

    prompts = [{"prompt_token_ids": torch.randint(10, vocab, (prompt_len,), generator=gen).tolist()}
               for _ in range(max(batches))]
    warm = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate(prompts, warm)  # compiles every prefill and decode shape measured below
    llm.generate(prompts[:1], warm)

    latency = _single_stream(llm, SamplingParams, prompts[0]["prompt_token_ids"][:single_prompt], single_output,
                             name)
    ctx = single_prompt + single_output / 2
    roofline_s = (step_weight_bytes + ctx * kv_per_token) / run.peak if run.peak else None
    run.emit("engine_single_stream", variant=name, prompt_len=single_prompt, output_len=single_output,
             per_token_latency_ms=round(latency * 1e3, 3),
             roofline_ms=round(roofline_s * 1e3, 3) if roofline_s else None,
             fraction_of_roofline=round(roofline_s / latency, 4) if roofline_s else None)

    ttft_len = 16 if tiny else 512
    run.emit("engine_ttft", variant=name, prompt_len=ttft_len,
             ttft_ms=round(_ttft(llm, SamplingParams, vocab, ttft_len, gen) * 1e3, 3),
             note="one prefill step of an idle engine, sampling included (median of 3)")

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for num_seqs in batches:
        if run.out_of_time():
            run.emit("skipped", what=f"throughput {name} x{num_seqs}", reason="time budget")
            continue
        run.sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:num_seqs], params)
        run.sync()
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        # Roofline: each decode step of the whole batch reads the weights once plus every
        # sequence's KV so far (mean context prompt + output / 2).
        step_bytes = step_weight_bytes + num_seqs * (prompt_len + output_len / 2) * kv_per_token
        roofline = num_seqs * run.peak / step_bytes if run.peak else None
        run.emit("engine_throughput", variant=name, num_requests=num_seqs, prompt_len=prompt_len,
                 output_len=output_len, output_tokens=tokens, wall_s=round(wall, 3),
                 output_tokens_per_s=round(tokens / wall, 1),
                 roofline_tokens_per_s=round(roofline, 1) if roofline else None,
                 fraction_of_roofline=round(tokens / wall / roofline, 4) if roofline else None,
                 note="wall time includes the prefill of every prompt")

    if first or options.get("quantization"):
        if graphs is not None and first:
            for rows, prompt in ((1, 0), (64, 0), (256, 0), (0, 512), (63, 500)) if not tiny else (
                    (1, 0), (3, 0), (0, 12), (2, 9)):
                if rows <= llm.engine.args.max_num_seqs:
                    run.emit("engine_graph_vs_eager", variant=name,
                             **_graph_vs_eager(runner, rows, run, context=20 if tiny else 100, prompt=prompt))
        run.emit("engine_step_profile", variant=name,
                 **_step_profile(llm, SamplingParams, prompts[0]["prompt_token_ids"][:single_prompt], run,
                                 steps=min(8, single_output - 2)))
    llm.shutdown()
    return reference


def _prompt_logits(runner, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits at every position of each prompt, one prefill each, over the pool's first
    blocks (run on an idle engine): [sum of lengths, vocab] fp32."""
    from pagefleet.worker.model_executor.model_runner import StepInput

    block_size = runner.kv_caches[0][0].shape[1]
    out = []
    for ids in prompts:
        n = len(ids)
        step = StepInput(ids, list(range(n)), list(range(n)), [list(range(-(-n // block_size)))], [0, n], [n],
                         list(range(n)))
        out.append(runner.execute(step).float().cpu())
    return torch.cat(out)


def _ttft(llm, sampling_params_cls, vocab: int, prompt_len: int, gen) -> float:
    engine = llm.engine
    times = []
    for i in range(4):  # the first compiles this prompt length's kernels: left out
        ids = torch.randint(10, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"ttft-{i}", ids, sampling_params_cls(temperature=0.0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _graph_vs_eager(runner, rows: int, run, context: int, prompt: int = 0, iters: int = 20) -> dict:
    """``rows`` decode rows at ``context`` tokens (with ``prompt``: one more sequence prefilling a
    ``prompt``-token prompt beside them, a mixed step) through the graph of their bucket and
    through the same static-buffer forward run eagerly: equal logits, and milliseconds of each.
    Writes KV into the pool's first blocks: run it with no request in flight."""
    from pagefleet.worker.model_executor.model_runner import StepInput

    block_size = runner.kv_caches[0][0].shape[1]
    per_seq = -(-max(context, prompt) // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(rows + (prompt > 0))]
    ids, pos, slots = [11] * rows, [context - 1] * rows, [t[-1] * block_size + (context - 1) % block_size
                                                          for t in tables[:rows]]
    starts, lens = list(range(rows + 1)), [context] * rows
    if prompt:
        ids += list(range(100, 100 + prompt))
        pos += list(range(prompt))
        slots += [tables[-1][p // block_size] * block_size + p % block_size for p in range(prompt)]
        starts.append(rows + prompt)
        lens.append(prompt)
    step = StepInput(ids, pos, slots, tables, starts, lens, list(range(rows)) + ([len(ids) - 1] if prompt else []))
    graphs = runner.prefill_graphs if prompt else runner.decode_graphs
    bucket = graphs.bucket(len(ids) if prompt else rows)

    def ms_per_step() -> float:
        graphs.run(step, bucket)
        run.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            graphs.run(step, bucket)
        run.sync()
        return (time.perf_counter() - t0) / iters * 1e3

    captured = graphs.capture
    replayed = graphs.run(step, bucket).clone()
    replay_ms = ms_per_step()
    graphs.capture = False
    try:
        eager = graphs.run(step, bucket).clone()
        eager_ms = ms_per_step()
    finally:
        graphs.capture = captured
    return {"kind": graphs.kind, "rows": rows, "prompt": prompt, "bucket": bucket, "context": context,
            "captured": captured, "outputs_equal": bool(torch.equal(replayed, eager)),
            "replay_ms": round(replay_ms, 3), "eager_ms": round(eager_ms, 3), "speedup": round(eager_ms / replay_ms, 2)}


def _single_stream(llm, sampling_params_cls, prompt: list[int], output_len: int, name: str) -> float:
    """Seconds per output token of one request after its first (the prefill step's) token: the
    decode steps' time over their tokens (a greedy window's step gives several)."""
    engine = llm.engine
    engine.add_request(f"single-{name}", prompt, sampling_params_cls(temperature=0.0, max_tokens=output_len,
                                                                    ignore_eos=True))
    engine.step()  # prefill, and the first token
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()  # the step's tokens are on the host when it returns
    return (time.perf_counter() - t0) / (output_len - 1)


def _step_profile(llm, sampling_params_cls, prompt: list[int], run, steps: int) -> dict:
    """``steps`` single-stream decode steps under torch.profiler: per step, the wall time, the
    device's kernel time (the rest is the host: Python, launches, the sampler's sync) and the
    kernel launches; the twelve kernels with the most device time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    engine.add_request("profiled", prompt, sampling_params_cls(temperature=0.0, max_tokens=steps + 2, ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # a decode step outside the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        run.sync()
        wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
    device_us = sum(sum(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"steps": steps, "wall_ms_per_step": round(wall / steps * 1e3, 3),
            "device_kernel_ms_per_step": round(device_us / steps / 1e3, 3),
            "device_busy_fraction": round(device_us / 1e6 / wall, 4) if wall else None,
            "kernel_events_per_step": round(sum(len(v) for v in kernels.values()) / steps, 1),
            "top_kernels": [{"name": name[:80], "ms_per_step": round(sum(v) / steps / 1e3, 3),
                             "launches_per_step": round(len(v) / steps, 1)} for name, v in top]}
