"""The prepared GPU check: kernels against their twins, kernel bandwidth, engine against the roofline.

Needs one CUDA GPU with torch, triton, transformers and safetensors (no Ray, no
network) and stays inside a time budget (default 420 s; gpu_check.sh adds a
hard timeout under 8 minutes). Prints one JSON line per result, each naming the
device:

  correctness  every Triton kernel against its PyTorch twin in bf16 and fp16
               (max abs error, the tolerance the interpreter tests justify, ok)
  bandwidth    achieved bytes/s of paged decode attention (batch 64, context
               2048, Llama-3-8B heads: 32 q, 8 kv, head_dim 128; a few launch
               configs), split-KV decode, and the norm/activation/rotary/KV-write
               kernels, as fractions of the device's peak (from its name; H200 = 4.8 TB/s)
  engine       offline throughput and single-stream per-token latency of a
               random-weight Llama-3-8B-shaped model in bf16, as fractions of
               the memory-bandwidth roofline (bytes a decode step must read / peak)
  moe          the same for a random-weight Qwen3-30B-A3B-shaped model cut to 12 of
               its 48 layers (128 experts, top 8), against the roofline of the
               experts each step reads (gpu_check_moe.py; eager, as the engine
               runs MoE models on CUDA today); the engine section leaves it
               MOE_RESERVE_S of the budget

`--dry-run` runs the same code on CPU with tiny shapes (Triton kernels under the
interpreter, the engine on its CPU twins) so CI proves the script works; its
timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from pagefleet.kernels import reference
from pagefleet.kernels.activation import silu_and_mul
from pagefleet.kernels.kv_cache_write import write_kv_cache
from pagefleet.kernels.paged_attention import AttentionConfig, default_config, paged_attention
from pagefleet.kernels.rms_norm import fused_add_rms_norm, rms_norm
from pagefleet.kernels.rotary import rotary_embedding
from pagefleet.kernels.testing import make_paged_batch

from gpu_check_engine import LLAMA3_SCALING, check_engine  # beside this file: the engine section
from gpu_check_moe import check_moe  # and the MoE section

# Peak HBM bandwidth (bytes/s) by device-name fragment, most specific first.
PEAK_BANDWIDTH = [("GH200", 4.0e12), ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12),
                  ("H100", 3.35e12), ("H800", 3.35e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12),
                  ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("L40", 0.864e12),
                  ("A10G", 0.6e12), ("RTX 4090", 1.008e12), ("L4", 0.3e12)]
# Tolerances justified in tests/test_kernels_*.py, in units of the dtype's eps: elementwise
# kernels pass when |a - e| <= atol + rtol |e| with (atol, rtol) below; attention when
# max |a - e| <= 3 eps max|V|.
# (The bf16 bounds, which also cover fp16.)
ELEMENTWISE_EPS = {"rms_norm": (3, 3), "fused_add_rms_norm": (4, 4), "silu_and_mul": (3, 3),
                   "rotary_embedding": (8, 2)}
ATTENTION_EPS = 3
# The budget's last seconds, kept from the engine section for the MoE one (start-up, the first
# calls' kernel compiles, then three timed runs).
MOE_RESERVE_S = 120.0


@dataclass(slots=True)
class Run:
    device: torch.device
    device_name: str
    dry_run: bool
    peak: float | None  # bytes/s
    deadline: float     # time.monotonic() after which optional work is skipped

    def emit(self, check: str, **fields) -> None:
        line = {"check": check, "device": self.device_name, "dry_run": self.dry_run, **fields}
        print(json.dumps(line), flush=True)

    def fraction(self, bytes_per_s: float) -> float | None:
        return round(bytes_per_s / self.peak, 4) if self.peak else None

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def timed(run: Run, fn, iters: int) -> float:
    """Median seconds per call after two warm-up calls (compiles, caches)."""
    fn()
    fn()
    samples = []
    for _ in range(max(1, iters // 5)):
        if run.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / 5)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# ------------------------------------------------------------------ correctness


def _elementwise(run: Run, kernel: str, dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor,
                 shape: str) -> None:
    eps = torch.finfo(dtype).eps
    atol, rtol = ELEMENTWISE_EPS[kernel]
    diff = (actual.double() - expected.double()).abs()
    ok = bool((diff <= atol * eps + rtol * eps * expected.double().abs()).all())
    run.emit("correctness", kernel=kernel, dtype=str(dtype).removeprefix("torch."), shape=shape,
             max_abs_error=float(diff.max()),
             max_error_in_eps=float((diff / (eps * expected.double().abs().clamp(min=1.0))).max()),
             tolerance=f"{atol} eps + {rtol} eps |expected|", ok=ok)


def _attention(run: Run, name: str, dtype, seqs, **kwargs) -> None:
    batch = make_paged_batch(seqs, num_q_heads=4 if run.dry_run else 32, num_kv_heads=2 if run.dry_run else 8,
                             head_dim=64 if run.dry_run else 128, block_size=16, dtype=dtype, device=run.device)
    scale = batch.query.shape[-1] ** -0.5
    out = paged_attention(*batch.args(), scale, **kwargs)
    expected = reference.paged_attention(*batch.args(), scale)
    err = float((out.double() - expected.double()).abs().max())
    tol = ATTENTION_EPS * torch.finfo(dtype).eps * float(batch.value_cache.abs().max())
    run.emit("correctness", kernel=name, dtype=str(dtype).removeprefix("torch."), seqs=seqs,
             max_abs_error=err, tolerance=tol, ok=err <= tol)


def check_correctness(run: Run) -> None:
    dev, tiny = run.device, run.dry_run
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        rows, hidden, inter = (7, 123, 123) if tiny else (1024, 4096, 14336)
        x = (3 * torch.randn(rows, hidden, generator=gen)).to(dev, dtype)
        res = torch.randn(rows, hidden, generator=gen).to(dev, dtype)
        w = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dev, dtype)
        _elementwise(run, "rms_norm", dtype, rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), f"{rows}x{hidden}")
        out, new_res = fused_add_rms_norm(x, res, w, 1e-5)
        exp_out, exp_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
        _elementwise(run, "fused_add_rms_norm", dtype, torch.cat([out, new_res]), torch.cat([exp_out, exp_res]),
                     f"{rows}x{hidden}")
        gate_up = (4 * torch.randn(rows, 2 * inter, generator=gen)).to(dev, dtype)
        _elementwise(run, "silu_and_mul", dtype, silu_and_mul(gate_up), reference.silu_and_mul(gate_up),
                     f"{rows}x{2 * inter}")

        hq, hkv, d = (5, 1, 64) if tiny else (32, 8, 128)
        cos_sin = reference.build_cos_sin_cache(d, 16384, 500000.0, LLAMA3_SCALING).to(dev)
        qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).to(dev, dtype)
        qkv_ref = qkv.clone()
        positions = torch.randint(0, 16384, (rows,), generator=gen).to(dev)
        views = [(t[:, :hq * d].view(rows, hq, d), t[:, hq * d:(hq + hkv) * d].view(rows, hkv, d))
                 for t in (qkv, qkv_ref)]
        rotary_embedding(positions, *views[0], cos_sin)
        reference.rotary_embedding(positions, *views[1], cos_sin)
        _elementwise(run, "rotary_embedding", dtype, qkv, qkv_ref, f"{rows} tokens, {hq}/{hkv} heads x {d}")

        k, v = views[0][1], qkv[:, (hq + hkv) * d:].view(rows, hkv, d)
        caches = [torch.zeros(rows // 16 + 2, 16, hkv, d, dtype=dtype, device=dev) for _ in range(4)]
        slots = torch.randperm(caches[0].shape[0] * 16, generator=gen)[:rows].to(dev)
        slots[::5] = -1
        write_kv_cache(k, v, caches[0], caches[1], slots)
        reference.write_kv_cache(k, v, caches[2], caches[3], slots)
        exact = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        run.emit("correctness", kernel="write_kv_cache", dtype=str(dtype).removeprefix("torch."),
                 shape=f"{rows} tokens, every 5th padding", max_abs_error=0.0 if exact else None,
                 tolerance="bit-exact", ok=exact)

        if tiny:
            mixed, decode = [(1, 40), (7, 30), (12, 12)], [(1, 50), (1, 17)]
        else:
            mixed, decode = [(1, 2048), (1, 700), (300, 1100), (512, 512), (1, 33)], [(1, 3000)] * 4
        _attention(run, "paged_attention", dtype, mixed)
        _attention(run, "paged_attention_decode", dtype, decode)  # CUDA: split-KV chosen for 4 x 8 programs
        _attention(run, "paged_attention_split_kv", dtype, decode, num_kv_splits=8)
        _fp8_kv(run, dtype, k, v, slots, mixed, decode)
        _fp8_weights(run, dtype, gen)


def _fp8_weights(run: Run, dtype, gen) -> None:
    """The few-token FP8-weight product against its twin: the same exact products in fp32 summed
    in another order (K eps32 sum|x w| s), then one rounding to the dtype (1 eps |expected|)."""
    from pagefleet.kernels.fp8_weight_matmul import fp8_weight_matmul

    eps32 = torch.finfo(torch.float32).eps
    shapes = [(1, 48, 80), (7, 80, 300)] if run.dry_run else [(1, 28672, 4096), (64, 4096, 14336), (5, 6144, 4096)]
    for tokens, n, k in shapes:
        x = torch.randn(tokens, k, generator=gen).to(run.device, dtype)
        w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(run.device, torch.float8_e4m3fn)
        scale = (torch.rand(n, generator=gen) * 0.01 + 1e-4).to(run.device)
        got = fp8_weight_matmul(x, w, scale, None, dtype).double()
        want = reference.fp8_weight_matmul(x, w, scale, None, dtype).double()
        bound = (k * eps32 * (x.double().abs() @ w.double().abs().t()) * scale.double()
                 + torch.finfo(dtype).eps * want.abs())
        run.emit("correctness", kernel="fp8_weight_matmul", dtype=str(dtype).removeprefix("torch."),
                 shape=f"{tokens} tokens x [{n}, {k}]", max_abs_error=float((got - want).abs().max()),
                 tolerance="K eps32 sum|x w| s + eps |expected|", ok=bool(((got - want).abs() <= bound).all()))


def _fp8_kv(run: Run, dtype, k, v, slots, mixed, decode) -> None:
    """The FP8 (e4m3) KV cache: the write bit-exact against the twin (the hardware cast against
    torch's), attention over fp8 caches within the twin's bound (ATTENTION_EPS + 1 eps for the
    v_scale multiply), at scales other than 1."""
    fp8 = torch.float8_e4m3fn
    k_scale, v_scale = 0.37, 3.0
    shape = (k.shape[0] // 16 + 2, 16, *k.shape[1:])
    caches = [torch.zeros(shape, dtype=fp8, device=run.device) for _ in range(4)]
    write_kv_cache(k, v, caches[0], caches[1], slots, k_scale=k_scale, v_scale=v_scale)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots, k_scale=k_scale, v_scale=v_scale)
    exact = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in ((caches[0], caches[2]),
                                                                                 (caches[1], caches[3])))
    run.emit("correctness", kernel="write_kv_cache_fp8", dtype=str(dtype).removeprefix("torch."),
             shape=f"{k.shape[0]} tokens, every 5th padding, scales {k_scale}/{v_scale}",
             max_abs_error=0.0 if exact else None, tolerance="bit-exact", ok=exact)
    for name, seqs, splits in (("paged_attention_fp8", mixed, None), ("paged_attention_split_kv_fp8", decode, 8)):
        batch = make_paged_batch(seqs, num_q_heads=4 if run.dry_run else 32, num_kv_heads=2 if run.dry_run else 8,
                                 head_dim=64 if run.dry_run else 128, block_size=16, dtype=dtype, device=run.device)
        key_cache = reference.quantize_kv(batch.key_cache, k_scale, fp8)
        value_cache = reference.quantize_kv(batch.value_cache, v_scale, fp8)
        args = (batch.query, key_cache, value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens)
        scale = batch.query.shape[-1] ** -0.5
        out = paged_attention(*args, scale, k_scale=k_scale, v_scale=v_scale, num_kv_splits=splits)
        expected = reference.paged_attention(*args, scale, k_scale=k_scale, v_scale=v_scale)
        err = float((out.double() - expected.double()).abs().max())
        max_v = float(value_cache.float().abs().max()) * v_scale
        tol = (ATTENTION_EPS + 1) * torch.finfo(dtype).eps * max_v
        run.emit("correctness", kernel=name, dtype=str(dtype).removeprefix("torch."), seqs=seqs,
                 max_abs_error=err, tolerance=tol, ok=err <= tol)


# -------------------------------------------------------------------- bandwidth


def _bandwidth(run: Run, kernel: str, fn, nbytes: int, iters: int, **fields) -> float:
    seconds = timed(run, fn, iters)
    bps = nbytes / seconds
    run.emit("bandwidth", kernel=kernel, bytes=nbytes, time_us=round(seconds * 1e6, 2),
             achieved_TBps=round(bps / 1e12, 4), fraction_of_peak=run.fraction(bps), **fields)
    return bps


def check_bandwidth(run: Run) -> None:
    dev, tiny = run.device, run.dry_run
    iters = 2 if tiny else 50
    dtype = torch.bfloat16
    copy_src = torch.empty(2**20 if tiny else 2**30, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    _bandwidth(run, "torch_copy (practical ceiling)", lambda: copy_dst.copy_(copy_src), 2 * copy_src.numel(), iters)

    batch_size, context = (2, 64) if tiny else (64, 2048)
    hq, hkv, d = (4, 2, 64) if tiny else (32, 8, 128)
    batch = make_paged_batch([(1, context)] * batch_size, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             block_size=16, dtype=dtype, device=dev, extra_blocks=0)
    kv_bytes = 2 * batch_size * context * hkv * d * dtype.itemsize
    nbytes = kv_bytes + 2 * batch.query.numel() * dtype.itemsize + batch.block_table.numel() * 4
    default = default_config(decode_only=True, group_pad=hq // hkv, head_dim=d, dtype=dtype)
    configs = [default] if tiny else [default] + [AttentionConfig(16, n, w, s) for n, w, s in
                                                  [(32, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 3), (64, 8, 3),
                                                   (128, 8, 3), (128, 8, 4)] if (n, w, s) != (
                                                      default.block_n, default.num_warps, default.num_stages)]
    for config in configs:
        if run.out_of_time():
            run.emit("skipped", what=f"paged_attention_decode {config}", reason="time budget")
            break
        _bandwidth(run, "paged_attention_decode", lambda c=config, a=batch.args(): paged_attention(
            *a, d**-0.5, num_kv_splits=1, config=c), nbytes, iters, batch=batch_size, context=context,
            heads=f"{hq}/{hkv}x{d}", config=str(config), default=config == default)

    # Few sequences, long context: split-KV against one program per (sequence, KV head).
    small_batch, long_context = (1, 128) if tiny else (4, 16384)
    batch = make_paged_batch([(1, long_context)] * small_batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             block_size=16, dtype=dtype, device=dev, extra_blocks=0)
    nbytes = 2 * small_batch * long_context * hkv * d * dtype.itemsize
    for splits in (1, None):
        _bandwidth(run, "paged_attention_decode_small_batch", lambda s=splits, a=batch.args(): paged_attention(
            *a, d**-0.5, num_kv_splits=s), nbytes, iters, batch=small_batch, context=long_context,
            num_kv_splits="auto" if splits is None else splits)
    del batch

    rows, hidden, inter = (16, 256, 256) if tiny else (16384, 4096, 14336)
    x, res = (torch.randn(rows, hidden, device=dev, dtype=dtype) for _ in range(2))
    w = torch.ones(hidden, device=dev, dtype=dtype)
    unit = rows * hidden * dtype.itemsize
    _bandwidth(run, "rms_norm", lambda: rms_norm(x, w, 1e-5), 2 * unit, iters, shape=f"{rows}x{hidden}")
    _bandwidth(run, "fused_add_rms_norm", lambda: fused_add_rms_norm(x, res, w, 1e-5), 4 * unit, iters,
               shape=f"{rows}x{hidden}")
    act_rows = rows // 2
    gate_up = torch.randn(act_rows, 2 * inter, device=dev, dtype=dtype)
    _bandwidth(run, "silu_and_mul", lambda: silu_and_mul(gate_up), 3 * act_rows * inter * dtype.itemsize, iters,
               shape=f"{act_rows}x{2 * inter}")
    q = torch.randn(rows, hq, d, device=dev, dtype=dtype)
    k = torch.randn(rows, hkv, d, device=dev, dtype=dtype)
    cos_sin = reference.build_cos_sin_cache(d, 8192, 500000.0, LLAMA3_SCALING).to(dev)
    positions = torch.randint(0, 8192, (rows,), device=dev)
    _bandwidth(run, "rotary_embedding", lambda: rotary_embedding(positions, q, k, cos_sin),
               2 * (q.numel() + k.numel()) * dtype.itemsize, iters, shape=f"{rows} tokens, {hq}/{hkv}x{d}")
    v = torch.randn_like(k)
    key_cache, value_cache = (torch.empty(rows // 16, 16, hkv, d, device=dev, dtype=dtype) for _ in range(2))
    slots = torch.randperm(rows, device=dev)
    _bandwidth(run, "write_kv_cache", lambda: write_kv_cache(k, v, key_cache, value_cache, slots),
               4 * k.numel() * dtype.itemsize, iters, shape=f"{rows} tokens, {hkv}x{d}")


# ----------------------------------------------------------------------- engine


# ------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: proves the script runs")
    parser.add_argument("--peak-tbps", type=float, help="peak memory bandwidth, if the device name is not known")
    parser.add_argument("--time-budget-s", type=float, default=420.0)
    parser.add_argument("--only", choices=["correctness", "bandwidth", "engine", "moe"], action="append")
    args = parser.parse_args()
    start = time.monotonic()
    if args.dry_run:
        device, name = torch.device("cpu"), "cpu (dry run)"
    elif torch.cuda.is_available():
        device, name = torch.device("cuda"), torch.cuda.get_device_name()
    else:
        raise SystemExit("gpu_check: no CUDA device (use --dry-run on a CPU machine)")
    peak = args.peak_tbps * 1e12 if args.peak_tbps else next((bw for frag, bw in PEAK_BANDWIDTH if frag in name),
                                                             None)
    run = Run(device, name, args.dry_run, None if args.dry_run else peak, start + args.time_budget_s)
    import triton

    run.emit("machine", torch=torch.__version__, triton=triton.__version__,
             cuda=torch.version.cuda, peak_TBps=peak / 1e12 if peak and not args.dry_run else None)
    failures = 0
    deadline = run.deadline
    moe_runs = not args.only or "moe" in args.only
    for section, fn in (("correctness", check_correctness), ("bandwidth", check_bandwidth),
                        ("engine", check_engine), ("moe", check_moe)):
        if args.only and section not in args.only:
            continue
        run.deadline = deadline - (MOE_RESERVE_S if section == "engine" and moe_runs and not args.dry_run else 0)
        if run.out_of_time():
            run.emit("skipped", what=section, reason="time budget")
            continue
        t0 = time.monotonic()
        try:
            fn(run)
        except Exception as e:  # one broken section must not hide the others' results
            failures += 1
            run.emit("error", section=section, error=f"{type(e).__name__}: {e}"[:2000])
        run.emit("section_done", section=section, seconds=round(time.monotonic() - t0, 1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
