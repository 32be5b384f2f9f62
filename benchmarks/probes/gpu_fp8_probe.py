"""Two questions the GPU check's FP8 figures raised, in one short device run (JSON lines):

  sweep    the few-token FP8-weight kernel (kernels/fp8_weight_matmul.py) over launch shapes at
           Llama-3-8B's four projection shapes, 1 and 64 tokens, beside bf16 F.linear on the same
           shapes: microseconds and achieved TB/s of weight bytes
  cosine   next-token logits of the random-weight 8B model against the same weights in fp32, for
           bf16, FP8 weights and the FP8 KV cache: how far plain bf16 rounding already moves a
           random 32-layer model, the yardstick for FP8's distance

`--dry-run` runs both on CPU with tiny shapes (the kernel under the interpreter) to prove the
script works; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagefleet.kernels.fp8_weight_matmul import FP8MatmulConfig, default_config, fp8_weight_matmul

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks beside probes/

from fp8_weights_check import time_ms  # noqa: E402
from gpu_check_engine import LLAMA3_8B, TINY, _prompt_logits, write_checkpoint_config  # noqa: E402

CONFIGS = [FP8MatmulConfig(*c) for c in [
    (16, 256, 4, 4, False), (32, 256, 4, 4, False), (64, 256, 4, 4, False), (64, 128, 4, 4, False),
    (32, 512, 4, 3, False), (64, 256, 8, 3, False), (16, 256, 4, 4, True), (32, 256, 4, 4, True),
    (64, 256, 4, 4, True), (32, 512, 8, 3, True), (64, 512, 8, 3, True), (128, 256, 8, 3, True)]]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def time_us(fn, device, iters: int = 20) -> float:
    if device.type == "cuda":
        return time_ms(fn, iters) * 1e3
    t0 = time.perf_counter()  # the dry run: one call, to prove the path
    fn()
    return (time.perf_counter() - t0) * 1e6


def sweep(device, tiny: bool) -> None:
    shapes = [(48, 80)] if tiny else [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]
    configs = CONFIGS[:2] if tiny else CONFIGS
    for n, k in shapes:
        w = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(n, device=device) * 0.01
        w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for tokens in (1, 64):
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            bf16 = time_us(lambda: torch.nn.functional.linear(x, w_bf16), device)
            emit(check="fp8_sweep", n=n, k=k, tokens=tokens, config="bf16 F.linear", us=round(bf16, 2),
                 TBps=round(2 * n * k / bf16 / 1e6, 3))
            for config in configs:
                us = time_us(lambda c=config: fp8_weight_matmul(x, w, scale, None, torch.bfloat16, config=c), device)
                emit(check="fp8_sweep", n=n, k=k, tokens=tokens, config=str(config),
                     default=config == default_config(n), us=round(us, 2), TBps=round(n * k / us / 1e6, 3),
                     vs_bf16=round(bf16 / us, 3))


def cosine(device, tiny: bool) -> None:
    from pagefleet.worker import LLM

    shape = TINY if tiny else LLAMA3_8B
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, shape["vocab_size"], (16 if tiny else 64,), generator=gen).tolist()
               for _ in range(2 if tiny else 8)]
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint_config(Path(tmp), shape)

        def engine(**kw):
            return LLM(model=tmp, load_format="dummy", device=device.type, block_size=16, max_num_seqs=8,
                       max_model_len=256 if not tiny else 64, kv_cache_bytes=(2 << 30) if not tiny else (4 << 20),
                       enable_prefix_caching=False, enforce_eager=True, **kw)

        bf16 = engine(dtype="bfloat16")
        ref_bf16 = _prompt_logits(bf16.engine.executor.runner, prompts)
        weights = {name: p.detach() for name, p in bf16.engine.executor.runner.model.named_parameters()}
        fp32 = engine(dtype="float32")
        with torch.no_grad():
            for name, p in fp32.engine.executor.runner.model.named_parameters():
                p.copy_(weights[name])  # the very same values, upcast exactly
        del weights
        bf16.shutdown()
        ref = _prompt_logits(fp32.engine.executor.runner, prompts)
        fp32.shutdown()
        results = {"bf16": ref_bf16}
        for name, kw in (("fp8 weights", {"quantization": "fp8"}), ("fp8 KV cache", {"kv_cache_dtype": "fp8"})):
            llm = engine(dtype="bfloat16", **kw)
            results[name] = _prompt_logits(llm.engine.executor.runner, prompts)
            llm.shutdown()
        for name, logits in results.items():
            for against, base in (("fp32, same weights", ref), ("bf16", ref_bf16)):
                if name == "bf16" and against == "bf16":
                    continue
                cos = torch.nn.functional.cosine_similarity(logits.double(), base.double(), dim=-1)
                emit(check="fp8_cosine", variant=name, against=against, positions=int(cos.numel()),
                     cosine_min=round(float(cos.min()), 5), cosine_mean=round(float(cos.mean()), 5),
                     greedy_agreement=round(float((logits.argmax(-1) == base.argmax(-1)).double().mean()), 4))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    emit(check="machine", device="cpu (dry run)" if args.dry_run else torch.cuda.get_device_name())
    for section in (sweep, cosine):
        t0 = time.monotonic()
        try:
            section(device, args.dry_run)
        except Exception as e:  # one section's failure must not hide the other's
            emit(check="error", section=section.__name__, error=f"{type(e).__name__}: {e}"[:2000])
        emit(check="section_done", section=section.__name__, seconds=round(time.monotonic() - t0, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
