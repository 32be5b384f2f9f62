"""kernels/ops.py: which implementation runs, per device and under PAGEFLEET_KERNELS."""

import os
import subprocess
import sys

import pytest
import torch

from pagefleet.kernels import ops, reference

NAMES = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache", "paged_attention"]


@pytest.mark.parametrize("value", [None, "auto", "", "TORCH", "torch"])
def test_cpu_tensors_run_the_twins(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ops.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ops.ENV_VAR, value)
    x = torch.zeros(2, 4)
    assert ops.backend_for(x) == "torch"
    for name in NAMES:
        assert ops.implementation(name, x) is getattr(reference, name)


def test_forced_triton_on_cpu_runs_the_interpreted_kernels(monkeypatch):
    pytest.importorskip("triton")
    from pagefleet.kernels import activation, kv_cache_write, paged_attention, rms_norm, rotary

    monkeypatch.setenv(ops.ENV_VAR, "triton")
    x = torch.zeros(2, 4)
    assert ops.backend_for(x) == "triton"
    assert ops.implementation("rms_norm", x) is rms_norm.rms_norm
    assert ops.implementation("fused_add_rms_norm", x) is rms_norm.fused_add_rms_norm
    assert ops.implementation("silu_and_mul", x) is activation.silu_and_mul
    assert ops.implementation("rotary_embedding", x) is rotary.rotary_embedding
    assert ops.implementation("write_kv_cache", x) is kv_cache_write.write_kv_cache
    assert ops.implementation("paged_attention", x) is paged_attention.paged_attention
    # And it really computes: the interpreted kernel through ops equals the twin here (fp32, one row).
    x = torch.arange(1.0, 9.0).view(2, 4)
    out = ops.silu_and_mul(x)
    torch.testing.assert_close(out, reference.silu_and_mul(x), rtol=1e-6, atol=1e-6)


def test_invalid_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="PAGEFLEET_KERNELS='cuda' is not one of auto, triton, torch"):
        ops.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6)


@pytest.mark.gpu
def test_cuda_tensors_run_triton_by_default(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    assert ops.backend_for(torch.zeros(1, device="cuda")) == "triton"


def test_ops_imports_and_runs_twins_without_triton():
    # As on macOS: importing triton fails; ops must import, run the twins, and
    # refuse a forced Triton with a clear error.
    code = """
import sys, os
sys.modules["triton"] = None
import torch
from pagefleet.kernels import ops
x = torch.randn(3, 8)
out = ops.rms_norm(x, torch.ones(8), 1e-6)
assert ops.backend_for(x) == "torch" and out.shape == (3, 8)
os.environ["PAGEFLEET_KERNELS"] = "triton"
try:
    ops.rms_norm(x, torch.ones(8), 1e-6)
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
