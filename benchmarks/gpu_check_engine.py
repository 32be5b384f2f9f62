"""The GPU check's engine section: offline throughput and single-stream per-token latency of a
random-weight Llama-3-8B-shaped model in bf16, as fractions of the memory-bandwidth roofline,
and where a single-stream decode step's time goes (the device's kernel time against the step's
wall time, kernel launches per step, the costliest kernels: torch.profiler).
Run through gpu_check.py, which passes its ``Run`` (device, peak bandwidth, time budget, emit)."""

from __future__ import annotations

import contextlib
import json
import os
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
                  bos_token_id=1, eos_token_id=2, dtype="bfloat16", hidden_act="silu", **shape)
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", unk_token="w0").save_pretrained(
        path)


def check_engine(run) -> None:  # run: gpu_check.Run
    from pagefleet.worker import LLM, SamplingParams

    tiny = run.dry_run
    shape = TINY if tiny else LLAMA3_8B
    num_seqs, prompt_len, output_len = (4, 8, 4) if tiny else (64, 128, 256)
    single_prompt, single_output = (8, 6) if tiny else (128, 128)
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2  # bf16
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint_config(Path(tmp), shape)
        t0 = time.monotonic()
        def make_llm():
            return LLM(model=tmp, load_format="dummy", dtype="bfloat16", device=run.device.type, block_size=16,
                       max_num_seqs=num_seqs, max_num_batched_tokens=8192 if not tiny else 256,
                       kv_cache_bytes=(num_seqs * (prompt_len + output_len) + 64 * 16) * kv_per_token,
                       # The pool is sized for this workload, not for the model's 8K context.
                       max_model_len=max(prompt_len + output_len, single_prompt + single_output),
                       enable_prefix_caching=False)

        llm = make_llm()
        model = llm.engine.executor.runner.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # A decode step reads every weight but the embedding table, of which it gathers a few rows.
        step_weight_bytes = weight_bytes - model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
        run.emit("engine_setup", model="Llama-3-8B-shaped, random weights" if not tiny else "tiny llama",
                 weight_bytes=weight_bytes, decode_step_weight_bytes=step_weight_bytes,
                 load_s=round(time.monotonic() - t0, 1),
                 kernels=model.kernels.backend)

        gen = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(10, shape["vocab_size"], (prompt_len,), generator=gen).tolist()}
                   for _ in range(num_seqs)]
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        # Warm-up on the measured shapes compiles their kernel variants (prefill; decode of the
        # full batch without splits; decode of one sequence with split-KV) outside the clock.
        warm = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        llm.generate(prompts, warm)
        llm.generate(prompts[:1], warm)

        run.sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        run.sync()
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        # Roofline: each decode step of the whole batch reads the weights once plus every
        # sequence's KV so far (mean context prompt + output / 2).
        step_bytes = step_weight_bytes + num_seqs * (prompt_len + output_len / 2) * kv_per_token
        roofline = num_seqs * run.peak / step_bytes if run.peak else None
        run.emit("engine_throughput", num_requests=num_seqs, prompt_len=prompt_len, output_len=output_len,
                 output_tokens=tokens, wall_s=round(wall, 3), output_tokens_per_s=round(tokens / wall, 1),
                 roofline_tokens_per_s=round(roofline, 1) if roofline else None,
                 fraction_of_roofline=round(tokens / wall / roofline, 4) if roofline else None,
                 note="wall time includes the prefill of every prompt")

        kernels = ["auto"] if tiny or run.out_of_time() else ["auto", "torch"]
        for choice in kernels:
            if choice != "auto":
                # Kernels are chosen once per engine: a second engine runs on the PyTorch twins.
                llm.shutdown()
                with _kernels_env(choice):
                    llm = make_llm()
            latency = _single_stream(llm, SamplingParams, prompts[0]["prompt_token_ids"][:single_prompt],
                                     single_output, choice)
            ctx = single_prompt + single_output / 2
            roofline_s = (step_weight_bytes + ctx * kv_per_token) / run.peak if run.peak else None
            run.emit("engine_single_stream", kernels=choice, prompt_len=single_prompt, output_len=single_output,
                     per_token_latency_ms=round(latency * 1e3, 3),
                     roofline_ms=round(roofline_s * 1e3, 3) if roofline_s else None,
                     fraction_of_roofline=round(roofline_s / latency, 4) if roofline_s else None)
            if choice == "auto":
                run.emit("engine_step_profile", kernels=choice,
                         **_step_profile(llm, SamplingParams, prompts[0]["prompt_token_ids"][:single_prompt], run,
                                         steps=min(8, single_output - 2)))
                run.emit("engine_decode_graph_probe", kernels=choice,
                         **_graph_probe(llm, run, context=min(single_prompt + single_output // 2,
                                                              single_prompt + single_output - 1)))


def _single_stream(llm, sampling_params_cls, prompt: list[int], output_len: int, name: str) -> float:
    """Median seconds per decode step of one request (the first step, its prefill, is left out)."""
    engine = llm.engine
    engine.add_request(f"single-{name}", prompt, sampling_params_cls(temperature=0.0, max_tokens=output_len,
                                                                    ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()  # samples on the host: the step's GPU work is finished when it returns
        steps.append(time.perf_counter() - t0)
    return statistics.median(steps[1:])


def _step_profile(llm, sampling_params_cls, prompt: list[int], run, steps: int) -> dict:
    """``steps`` single-stream decode steps under torch.profiler: per step, the wall time, the
    device's kernel time (the rest is the host: Python, launches, the sampler's sync) and the
    kernel launches; the five kernels with the most device time."""
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
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:5]
    return {"steps": steps, "wall_ms_per_step": round(wall / steps * 1e3, 3),
            "device_kernel_ms_per_step": round(device_us / steps / 1e3, 3),
            "device_busy_fraction": round(device_us / 1e6 / wall, 4) if wall else None,
            "kernel_launches_per_step": round(sum(len(v) for v in kernels.values()) / steps, 1),
            "top_kernels": [{"name": name[:80], "ms_per_step": round(sum(v) / steps / 1e3, 3),
                             "launches_per_step": round(len(v) / steps, 1)} for name, v in top]}


def _graph_probe(llm, run, context: int, iters: int = 20) -> dict:
    """The model's forward pass for one decode row at ``context`` tokens, eagerly and replayed as
    a CUDA graph (the same kernels on the same static tensors): milliseconds of each and whether
    their outputs are equal. What capturing decode steps would save; the engine does not yet.
    The step writes its KV into the pool's first blocks: run it with no request in flight."""
    from pagefleet.worker.model_executor.model_runner import StepInput

    runner = llm.engine.executor.runner
    block_size = runner.kv_caches[0][0].shape[1]
    blocks = list(range(-(-context // block_size)))  # the pool's first blocks, in order
    slot = blocks[-1] * block_size + (context - 1) % block_size
    step = StepInput([0], [context - 1], [slot], [blocks], [0, 1], [context], [0])
    with torch.inference_mode():  # as the engine builds them
        input_ids, positions, meta, _ = runner._tensors(step)

    def forward():
        return runner.model(input_ids, positions, meta, runner.kv_caches)

    def ms_per_call(fn) -> float:
        fn()
        run.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        run.sync()
        return (time.perf_counter() - t0) / iters * 1e3

    with torch.inference_mode():
        eager = forward().clone()
        eager_ms = ms_per_call(forward)
        if run.device.type != "cuda":
            return {"context": context, "eager_forward_ms": round(eager_ms, 3), "graph_replay_ms": None,
                    "outputs_equal": None, "note": "CUDA graphs need a CUDA device"}
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
                for _ in range(2):
                    forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = forward()
            graph.replay()
            run.sync()
        except Exception as e:  # what stops a capture is the finding; the section goes on
            return {"context": context, "eager_forward_ms": round(eager_ms, 3), "graph_replay_ms": None,
                    "outputs_equal": None, "capture_error": f"{type(e).__name__}: {str(e)[:300]}"}
        equal = bool(torch.equal(captured, eager))
        graph_ms = ms_per_call(graph.replay)
    return {"context": context, "eager_forward_ms": round(eager_ms, 3), "graph_replay_ms": round(graph_ms, 3),
            "speedup": round(eager_ms / graph_ms, 2), "outputs_equal": equal}


@contextlib.contextmanager
def _kernels_env(choice: str):
    saved = os.environ.get("PAGEFLEET_KERNELS")
    os.environ["PAGEFLEET_KERNELS"] = choice
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PAGEFLEET_KERNELS", None)
        else:
            os.environ["PAGEFLEET_KERNELS"] = saved
