"""`benchmarks/host_step.py` runs the simulated engine and prints one line per batch size."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_step_times_build_and_fill_of_decode_steps():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_step.py"), "--batches", "4", "8",
                             "--prompt-len", "40", "--output-len", "12", "--label", "x"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["batch"], r["prompt_len"], r["output_len"], r["label"]) for r in lines] == [(4, 40, 12, "x"),
                                                                                           (8, 40, 12, "x")]
    for r in lines:
        # The longest request makes at least 11 tokens, the first in its prefill step and the
        # others in decode steps.
        assert r["decode_steps"] >= 10
        assert r["build_us_median"] > 0 and r["fill_us_median"] > 0
