"""The GPU side of every kernel compiles for an H100/H200 (sm_90), without a GPU.

CI has no GPU, and the interpreter accepts programs the compiler rejects
(tl.dot shapes, loop-carried types, constexpr misuse). Each launcher is run on
small CPU tensors with the launch intercepted; the recorded arguments, with the
interpreter-only UPCAST switch off and specialised as a CUDA launch would
specialise them (16-divisible ints and pointers hinted, ints equal to 1 made
constants, except the kernel's do_not_specialize arguments), go through
triton.compile down to a cubin for sm_90 (Triton ships ptxas). Shapes are
Llama-3-8B's: the specialisations the engine launches in bf16, plus fp16/fp32
attention.
"""

import inspect
import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    # Triton's own library functions were then built for the interpreter and cannot be compiled.
    pytest.skip("TRITON_INTERPRET=1: this process cannot compile kernels", allow_module_level=True)

try:  # compiler internals (stable through triton 3.x); another triton skips rather than fails
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:  # pragma: no cover
    pytest.skip(f"triton's ahead-of-time compile API is not available: {e}", allow_module_level=True)

from pagefleet.kernels import activation, fp8_weight_matmul, kv_cache_write, paged_attention, rms_norm, rotary  # noqa: E402,E501
from pagefleet.kernels.testing import make_paged_batch  # noqa: E402
from pagefleet.kernels.triton_kernel import TritonKernel  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
SM90_MAX_SHARED_BYTES = 227 * 1024  # opt-in dynamic shared memory per block on H100/H200


class _Recorder:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda **kwargs: self.launches.append((self.kernel, grid, kwargs))


def _record(monkeypatch, fn) -> list:
    launches = []
    monkeypatch.setattr(TritonKernel, "on", lambda self, device: _Recorder(self, launches))
    fn()
    assert launches, "the launcher launched nothing"
    return launches


def _compile_for_sm90(kernel: TritonKernel, kwargs: dict):
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    for interpreter_only in ("UPCAST", "ROUND_TO_E4M3"):
        if interpreter_only in kwargs:
            kwargs[interpreter_only] = False  # what a CUDA launch passes
    params = inspect.signature(kernel.fn).parameters
    assert set(params) == set(kwargs), f"launcher arguments differ from {kernel.__name__}'s parameters"
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, param) in enumerate(params.items()):
        if "constexpr" in str(param.annotation):
            signature[name], constexprs[(index,)] = "constexpr", kwargs[name]
            continue
        specialize = name not in kernel.do_not_specialize
        ty, key = native_specialize_impl(BaseBackend, kwargs[name], False, specialize, True)
        signature[name] = ty
        if ty == "constexpr":  # an int equal to 1
            constexprs[(index,)] = key
        elif key == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel.compiled(), signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=SM90, options=options)


def _llama8b_batch(seqs, dtype=torch.bfloat16):
    return make_paged_batch(seqs, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype,
                            extra_blocks=0)


def _gpt_oss_batch(seqs):
    return make_paged_batch(seqs, num_q_heads=64, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16,
                            extra_blocks=0)


def _fp8_caches(batch):
    q, key_cache, value_cache, *rest = batch.args()
    return (q, key_cache.to(torch.float8_e4m3fn), value_cache.to(torch.float8_e4m3fn), *rest)


LAUNCHERS = {
    "rms_norm": lambda: rms_norm.rms_norm(torch.randn(2, 4096).bfloat16(), torch.ones(4096).bfloat16(), 1e-5),
    "fused_add_rms_norm": lambda: rms_norm.fused_add_rms_norm(
        torch.randn(2, 4096).bfloat16(), torch.randn(2, 4096).bfloat16(), torch.ones(4096).bfloat16(), 1e-5),
    "silu_and_mul": lambda: activation.silu_and_mul(torch.randn(2, 2 * 14336).bfloat16()),
    "rotary_embedding": lambda: rotary.rotary_embedding(
        torch.tensor([0, 5]), torch.randn(2, 32, 128).bfloat16(), torch.randn(2, 8, 128).bfloat16(),
        torch.randn(16, 128)),
    "write_kv_cache": lambda: kv_cache_write.write_kv_cache(
        torch.randn(2, 8, 128).bfloat16(), torch.randn(2, 8, 128).bfloat16(),
        torch.zeros(4, 16, 8, 128).bfloat16(), torch.zeros(4, 16, 8, 128).bfloat16(), torch.tensor([0, 17])),
    "paged_attention_decode_bf16": lambda: paged_attention.paged_attention(
        *_llama8b_batch([(1, 20), (1, 3)]).args(), 128**-0.5),
    "paged_attention_mixed_bf16": lambda: paged_attention.paged_attention(
        *_llama8b_batch([(1, 20), (5, 9)]).args(), 128**-0.5),
    "paged_attention_split_decode_bf16": lambda: paged_attention.paged_attention(
        *_llama8b_batch([(1, 20)]).args(), 128**-0.5, num_kv_splits=8),
    # A sliding-window layer (Mistral v0.1's 4096 tokens): its own specialisation of the kernel.
    "paged_attention_mixed_bf16_sliding": lambda: paged_attention.paged_attention(
        *_llama8b_batch([(1, 20), (5, 9)]).args(), 128**-0.5, sliding_window=4096),
    "paged_attention_split_decode_bf16_sliding": lambda: paged_attention.paged_attention(
        *_llama8b_batch([(1, 20)]).args(), 128**-0.5, sliding_window=4096, num_kv_splits=8),
    # gpt-oss-20b's attention (64 query heads, 8 KV heads of 64): sinks, with its 128-token window.
    "paged_attention_mixed_bf16_sinks_sliding": lambda: paged_attention.paged_attention(
        *_gpt_oss_batch([(1, 20), (5, 9)]).args(), 64**-0.5, sliding_window=128, sinks=torch.zeros(64)),
    "paged_attention_split_decode_bf16_sinks": lambda: paged_attention.paged_attention(
        *_gpt_oss_batch([(1, 20)]).args(), 64**-0.5, sinks=torch.zeros(64), num_kv_splits=8),
    "paged_attention_mixed_fp16": lambda: paged_attention.paged_attention(
        *_llama8b_batch([(1, 20), (5, 9)], torch.float16).args(), 128**-0.5),
    "paged_attention_mixed_fp32": lambda: paged_attention.paged_attention(
        *_llama8b_batch([(1, 20), (5, 9)], torch.float32).args(), 128**-0.5),
    "write_kv_cache_fp8": lambda: kv_cache_write.write_kv_cache(
        torch.randn(2, 8, 128).bfloat16(), torch.randn(2, 8, 128).bfloat16(),
        torch.zeros(4, 16, 8, 128, dtype=torch.float8_e4m3fn), torch.zeros(4, 16, 8, 128, dtype=torch.float8_e4m3fn),
        torch.tensor([0, 17]), k_scale=0.5, v_scale=2.0),
    "paged_attention_mixed_bf16_fp8_cache": lambda: paged_attention.paged_attention(
        *_fp8_caches(_llama8b_batch([(1, 20), (5, 9)])), 128**-0.5, k_scale=0.5, v_scale=2.0),
    "paged_attention_split_decode_fp16_fp8_cache": lambda: paged_attention.paged_attention(
        *_fp8_caches(_llama8b_batch([(1, 20)], torch.float16)), 128**-0.5, k_scale=0.5, v_scale=2.0,
        num_kv_splits=8),
    # FP8 weights, few tokens: Llama-3-8B's gate|up (wide: 64 columns a program) and down (16).
    "fp8_weight_matmul_wide": lambda: fp8_weight_matmul.fp8_weight_matmul(
        torch.randn(1, 4096).bfloat16(), torch.zeros(28672, 4096, dtype=torch.float8_e4m3fn), torch.ones(28672),
        None, torch.bfloat16),
    "fp8_weight_matmul_narrow": lambda: fp8_weight_matmul.fp8_weight_matmul(
        torch.randn(64, 14336).bfloat16(), torch.zeros(4096, 14336, dtype=torch.float8_e4m3fn), torch.ones(4096),
        torch.randn(4096).bfloat16(), torch.bfloat16),
    "fp8_weight_matmul_load_nk": lambda: fp8_weight_matmul.fp8_weight_matmul(
        torch.randn(1, 4096).bfloat16(), torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn), torch.ones(4096),
        None, torch.bfloat16, config=fp8_weight_matmul.FP8MatmulConfig(32, 512, 8, 3, load_nk=True)),
}


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_kernel_compiles_for_sm90(monkeypatch, name):
    launches = _record(monkeypatch, LAUNCHERS[name])
    for kernel, grid, kwargs in launches:
        assert all(0 < g < 2**31 for g in grid) and all(g <= 65535 for g in grid[1:]), grid
        compiled = _compile_for_sm90(kernel, kwargs)
        assert compiled.asm["cubin"], kernel.__name__
        assert compiled.metadata.shared <= SM90_MAX_SHARED_BYTES, (kernel.__name__, compiled.metadata.shared)
