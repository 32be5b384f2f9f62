"""kernels/ops.py: which implementation runs, per device and under PAGEFLEET_KERNELS, decided once."""

import os
import subprocess
import sys

import pytest
import torch

from pagefleet.kernels import ops, reference

NAMES = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache", "paged_attention"]


@pytest.mark.parametrize("value", [None, "auto", "", "TORCH", "torch"])
def test_cpu_runs_the_twins(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ops.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ops.ENV_VAR, value)
    kernels = ops.select_kernels(torch.device("cpu"))
    assert kernels.backend == "torch"
    for name in NAMES:
        assert getattr(kernels, name) is getattr(reference, name)


def test_forced_triton_on_cpu_runs_the_interpreted_kernels(monkeypatch):
    pytest.importorskip("triton")
    from pagefleet.kernels import activation, kv_cache_write, paged_attention, rms_norm, rotary

    monkeypatch.setenv(ops.ENV_VAR, "triton")
    kernels = ops.select_kernels("cpu")
    assert kernels.backend == "triton"
    assert kernels.rms_norm is rms_norm.rms_norm
    assert kernels.fused_add_rms_norm is rms_norm.fused_add_rms_norm
    assert kernels.silu_and_mul is activation.silu_and_mul
    assert kernels.rotary_embedding is rotary.rotary_embedding
    assert kernels.write_kv_cache is kv_cache_write.write_kv_cache
    assert kernels.paged_attention is paged_attention.paged_attention
    # And it really computes: the interpreted kernel equals the twin here (fp32, one row).
    x = torch.arange(1.0, 9.0).view(2, 4)
    torch.testing.assert_close(kernels.silu_and_mul(x), reference.silu_and_mul(x), rtol=1e-6, atol=1e-6)


def test_the_choice_is_made_once(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    kernels = ops.select_kernels("cpu")
    monkeypatch.setenv(ops.ENV_VAR, "bogus")  # read at selection only: the chosen set keeps working
    x = torch.randn(3, 8)
    torch.testing.assert_close(kernels.rms_norm(x, torch.ones(8), 1e-6), reference.rms_norm(x, torch.ones(8), 1e-6))


def test_invalid_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="PAGEFLEET_KERNELS='cuda' is not one of auto, triton, torch"):
        ops.select_kernels("cpu")


@pytest.mark.gpu
def test_cuda_runs_triton_by_default(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    assert ops.select_kernels(torch.device("cuda")).backend == "triton"


def test_ops_imports_and_runs_twins_without_triton():
    # As on macOS: importing triton fails; ops must import, run the twins, and
    # refuse a forced Triton with a clear error.
    code = """
import sys, os
sys.modules["triton"] = None
import torch
from pagefleet.kernels import ops
kernels = ops.select_kernels("cpu")
out = kernels.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
assert kernels.backend == "torch" and out.shape == (3, 8)
os.environ["PAGEFLEET_KERNELS"] = "triton"
try:
    ops.select_kernels("cpu")
except RuntimeError as e:
    assert "not installed" in str(e), e
else:
    raise AssertionError("forced triton without triton did not raise")
assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != ops.ENV_VAR})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
