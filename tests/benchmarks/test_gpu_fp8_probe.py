"""`benchmarks/probes/gpu_fp8_probe.py --dry-run`: the FP8 probe's code runs on CPU and prints what it promises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_probe_dry_run_prints_the_sweep_and_the_cosines():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "gpu_fp8_probe.py"), "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert not [line for line in lines if line["check"] == "error"]
    sweep = [line for line in lines if line["check"] == "fp8_sweep"]
    assert {(s["tokens"], s["config"].split("(")[0]) for s in sweep} == {
        (t, c) for t in (1, 64) for c in ("bf16 F.linear", "FP8MatmulConfig")}
    cosines = {(c["variant"], c["against"]): c for c in lines if c["check"] == "fp8_cosine"}
    assert set(cosines) == {("bf16", "fp32, same weights"), ("fp8 weights", "fp32, same weights"),
                            ("fp8 weights", "bf16"), ("fp8 KV cache", "fp32, same weights"), ("fp8 KV cache", "bf16")}
    # The tiny 2-layer model: bf16 rounding and FP8 both stay close to fp32.
    assert all(c["positions"] == 32 and c["cosine_min"] > 0.99 for c in cosines.values())
