"""GPU check of FP8 weights (worker/model_executor/fp8.py), about a minute on one Hopper/Ada GPU.

1. ``fp8_matmul_cuda`` (torch._scaled_mm, row-wise scales) and ``fp8_matmul_twin`` against the
   same product in float64 on the same quantized inputs, over odd token counts, three output
   dtypes, with and without bias: the error beyond the output cast, relative to the sum of
   absolute terms (fp32 accumulation keeps it under in * 2^-24).
2. Whether _scaled_mm takes a token count that is not a multiple of 16.
3. The fp8 linear under CUDA graph capture and replay.
4. Time per call, bf16 F.linear against fp8_linear (quantizing the activations included),
   launched eagerly and replayed from a CUDA graph.
5. An engine on the tiny demo checkpoint (bf16), quantization=None against "fp8": next-token
   logits' cosine similarity, greedy tokens.

    python benchmarks/fp8_weights_check.py [--out results.json] [--skip-engine]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import torch.nn.functional as F

from pagefleet.worker.model_executor.fp8 import (
    fp8_linear,
    fp8_matmul_cuda,
    fp8_matmul_twin,
    quantize_per_token,
    quantize_weight,
)

# Round to nearest in the output dtype moves a value by at most half its eps, relatively.
HALF_EPS = {dt: torch.finfo(dt).eps / 2 for dt in (torch.bfloat16, torch.float16, torch.float32)}


def check_against_twin(dev: torch.device) -> list[dict]:
    """Both paths against the same product in float64 on the same quantized inputs. The error is
    given relative to each output's sum of absolute terms (``mag``): fp32 accumulation in any
    order stays within in * 2^-24 of it; a cast to the output dtype adds half its ulp of |y|."""
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for in_f, out_f in ((128, 256), (4096, 6144)):
        w, sw = quantize_weight(torch.randn(out_f, in_f, device=dev, generator=gen, dtype=torch.bfloat16))
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            bias = torch.randn(out_f, device=dev, generator=gen).to(out_dtype)
            for with_bias in (False, True):
                for tokens in (1, 5, 33, 257):
                    x = torch.randn(tokens, in_f, device=dev, generator=gen, dtype=torch.bfloat16)
                    xq, sx = quantize_per_token(x)
                    b = bias if with_bias else None
                    x64, w64 = xq.double() * sx.double(), w.double() * sw.double()[:, None]
                    ref = x64 @ w64.t() + (b.double() if with_bias else 0)
                    mag = x64.abs() @ w64.abs().t()
                    row = {"in": in_f, "out": out_f, "dtype": str(out_dtype), "bias": with_bias, "T": tokens}
                    for name, fn in (("cuda", fp8_matmul_cuda), ("twin", fp8_matmul_twin)):
                        try:
                            got = fn(xq, sx, w, sw, b, out_dtype).double()
                        except RuntimeError as e:  # a combination _scaled_mm refuses: reported, not fatal
                            row[name] = f"{type(e).__name__}: {e}"[:200]
                            continue
                        cast = (got - ref).abs() - HALF_EPS[out_dtype] * ref.abs()
                        row[f"{name}_err_over_mag"] = (cast.clamp(min=0) / mag).max().item()
                    row["in_x_2^-24"] = in_f * 2.0**-24
                    rows.append(row)
    return rows


def raw_unpadded(dev: torch.device) -> dict:
    out = {}
    w, sw = quantize_weight(torch.randn(256, 128, device=dev))
    for tokens in (1, 5, 17):
        xq, sx = quantize_per_token(torch.randn(tokens, 128, device=dev))
        try:
            torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=sw.view(1, -1), out_dtype=torch.bfloat16)
            out[tokens] = "ok"
        except RuntimeError as e:
            out[tokens] = f"{type(e).__name__}: {e}"[:300]
    return out


def graph_capture(dev: torch.device) -> dict:
    w, sw = quantize_weight(torch.randn(512, 256, device=dev))
    x = torch.randn(7, 256, device=dev, dtype=torch.bfloat16)
    eager = fp8_linear(x, w, sw, None, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fp8_linear(x, w, sw, None, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, w, sw, None, torch.bfloat16)
    x.copy_(x * 2)
    graph.replay()
    again = fp8_linear(x, w, sw, None, torch.bfloat16)
    return {"replay_equals_eager": bool(torch.equal(y, again)), "changed_with_input": not torch.equal(y, eager)}


def time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_ms(fn, iters: int = 50) -> float:
    """Time per call of ``fn`` replayed from a CUDA graph (no launch or Python overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def timings(dev: torch.device) -> list[dict]:
    rows = []
    for in_f, out_f in ((4096, 14336 * 2), (14336, 4096)):
        wb = torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16) * 0.02
        w, sw = quantize_weight(wb)
        for tokens in (1, 16, 128, 1024, 4096):
            x = torch.randn(tokens, in_f, device=dev, dtype=torch.bfloat16)
            xq, sx = quantize_per_token(x)
            bf16 = time_ms(lambda x=x, wb=wb: F.linear(x, wb))
            fp8 = time_ms(lambda x=x, w=w, sw=sw: fp8_linear(x, w, sw, None, torch.bfloat16))
            mm = time_ms(lambda xq=xq, sx=sx, w=w, sw=sw: fp8_matmul_cuda(xq, sx, w, sw, None, torch.bfloat16))
            g_bf16 = graph_ms(lambda x=x, wb=wb: F.linear(x, wb))
            g_fp8 = graph_ms(lambda x=x, w=w, sw=sw: fp8_linear(x, w, sw, None, torch.bfloat16))
            rows.append({"in": in_f, "out": out_f, "T": tokens, "bf16_ms": round(bf16, 4),
                         "fp8_ms": round(fp8, 4), "fp8_matmul_only_ms": round(mm, 4),
                         "graph_bf16_ms": round(g_bf16, 4), "graph_fp8_ms": round(g_fp8, 4),
                         "graph_speedup": round(g_bf16 / g_fp8, 3)})
    return rows


def engine(dev: torch.device) -> dict:
    from pagefleet.cluster.demo.model import write_demo_checkpoint
    from pagefleet.worker import LLM, SamplingParams
    from pagefleet.worker.model_executor.model_config import load_model_config
    from pagefleet.worker.model_executor.model_runner import ModelRunner, StepInput
    from pagefleet.worker.parallel.tp_group import SINGLE

    ckpt = write_demo_checkpoint(tempfile.mkdtemp() + "/tiny", arch="llama", dtype="bfloat16")
    cfg = load_model_config(str(ckpt))
    n = 20
    ids = list(range(3, 3 + 7 * n, 7))
    step = StepInput(ids, list(range(n)), list(range(n)), [[0, 1]], [0, n], [n], list(range(n)))
    logits, weight_bytes = {}, {}
    for q in (None, "fp8"):
        runner = ModelRunner(cfg, SINGLE, dev, quantization=q)
        runner.allocate_kv_cache(8, 16)
        logits[q] = runner.execute(step)
        weight_bytes[q] = runner.weight_bytes()
        del runner
    cos = F.cosine_similarity(logits[None], logits["fp8"], dim=-1)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for q in (None, "fp8"):
        llm = LLM(model=str(ckpt), device="cuda", quantization=q, kv_cache_bytes=64 << 20)
        tokens[str(q)] = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
        llm.shutdown()
    return {"cosine_min": cos.min().item(), "cosine_mean": cos.mean().item(),
            "top1_agree": (logits[None].argmax(-1) == logits["fp8"].argmax(-1)).float().mean().item(),
            "weight_bytes": {str(k): v for k, v in weight_bytes.items()}, "greedy_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    dev = torch.device("cuda")
    report = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "allow_tf32": torch.backends.cuda.matmul.allow_tf32}
    started = time.monotonic()
    for name, part in (("twin", check_against_twin), ("raw_unpadded", raw_unpadded), ("graph", graph_capture),
                       ("timings", timings), ("engine", engine)):
        if name == "engine" and args.skip_engine:
            continue
        try:
            report[name] = part(dev)
        except Exception as e:  # noqa: BLE001 -- one part failing still reports the others
            report[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        print(name, json.dumps(report[name])[:3000], f"({time.monotonic() - started:.0f} s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
