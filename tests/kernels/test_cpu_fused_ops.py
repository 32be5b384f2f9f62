"""The CPU engine's C++ norms and rotary (kernels/cpu/fused_ops.py) against their twins in
reference.py, on the layouts the engine passes (row views into wider buffers), and the twins'
own answers wherever the layout or dtype is not one the C++ pass takes.

fp32 tolerance: the C++ sums are vectorised (reassociated) and products may fuse into FMAs, so
the last bits can differ from the twins': torch's default fp32 tolerance (rtol 1.3e-6, atol
1e-5). A wrong eps, a missing weight, a swapped sin sign or a wrong stride moves outputs by
orders of magnitude more."""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels import reference
from pagefleet.kernels.cpu import fused_ops as fused
from pagefleet.kernels.ops import select_kernels


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path_factory.getbasetemp() / "pagefleet-cache"))


@pytest.mark.parametrize("rows", [1, 5, 130])  # 130: rows spread over the threads
def test_norms_match_the_twins(rows):
    torch.manual_seed(rows)
    wide = torch.randn(rows, 3 * 96)
    x = wide[:, 96:192]  # a row view: stride 288, as a slice of a fused projection is
    residual, weight = torch.randn(rows, 96), torch.randn(96)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    got, got_residual = fused.fused_add_rms_norm(x, residual, weight, 1e-5)
    want, want_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=0)  # one add: exact
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("rows", [1, 7, 100])
def test_rotary_matches_the_twin_in_place_on_qkv_views(rows):
    torch.manual_seed(rows)
    heads, kv_heads, d = 4, 2, 32
    cos_sin = reference.build_cos_sin_cache(d, 512, 10000.0, None)
    positions = torch.randint(0, 512, (rows,))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    q = qkv[:, :heads * d].view(rows, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d)
    want_q, want_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cos_sin)
    untouched = qkv[:, (heads + kv_heads) * d:].clone()
    got_q, got_k = fused.rotary_embedding(positions, q, k, cos_sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], untouched)  # v is left alone


def test_other_layouts_and_dtypes_take_the_twins():
    torch.manual_seed(0)
    weight = torch.randn(16)
    per_head = torch.randn(3, 4, 16)  # Qwen3's q/k norm over [tokens, heads, head_dim]
    assert torch.equal(fused.rms_norm(per_head, weight, 1e-6), reference.rms_norm(per_head, weight, 1e-6))
    half = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(fused.rms_norm(half, weight.bfloat16(), 1e-6),
                       reference.rms_norm(half, weight.bfloat16(), 1e-6))
    q, k = torch.randn(2, 4, 16, dtype=torch.bfloat16), torch.randn(2, 2, 16, dtype=torch.bfloat16)
    cos_sin = reference.build_cos_sin_cache(16, 64, 10000.0, None)
    positions = torch.tensor([3, 9])
    want = reference.rotary_embedding(positions, q.clone(), k.clone(), cos_sin)
    got = fused.rotary_embedding(positions, q, k, cos_sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_with_fused_ops_replaces_only_the_norms_and_rotary():
    twins = select_kernels("cpu")
    kernels = fused.with_fused_ops(twins)
    assert (kernels.rms_norm, kernels.fused_add_rms_norm, kernels.rotary_embedding) == (
        fused.rms_norm, fused.fused_add_rms_norm, fused.rotary_embedding)
    assert (kernels.silu_and_mul, kernels.write_kv_cache, kernels.paged_attention, kernels.backend) == (
        twins.silu_and_mul, twins.write_kv_cache, twins.paged_attention, twins.backend)


def test_loading_the_compiled_kernels_leaves_the_process_floats_alone(tmp_path):
    """Built with -ffast-math, but not linked with it: crtfastmath.o would turn on flush-to-zero
    in the engine's process, where Python's own floats (a request's top_p of 5e-324) then
    compare as 0."""
    code = ("import torch; from pagefleet.kernels.cpu import fused_ops as f, decode_attention as d\n"
            "f.rms_norm(torch.randn(2, 64), torch.randn(64), 1e-5)\n"
            "d.decode_kernel(torch.float32, 64, 2, 2, 16)\n"
            "tiny = float('5e-324'); print(tiny > 0.0, repr(tiny), torch.tensor([tiny], dtype=torch.float64).item())")
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PAGEFLEET_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "5e-324", "5e-324"]
