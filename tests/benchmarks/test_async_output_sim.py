"""`benchmarks/async_output_sim.py` runs and prints one line per run and a ratio line per batch."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_async_output_sim_prints_both_settings_and_their_ratio():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "async_output_sim.py"), "--batches", "4",
                             "--output-len", "6", "--prompt-len", "8", "--rounds", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    runs, (ratio,) = lines[:-1], lines[-1:]
    assert [(r["batch"], r["async_output_proc"]) for r in runs] == [(4, False), (4, True)]
    assert all(r["output_tokens_per_s"] > 0 for r in runs)
    # One round each: the medians are the two runs themselves.
    assert (ratio["median_off"], ratio["median_on"]) == (round(runs[0]["output_tokens_per_s"]),
                                                         round(runs[1]["output_tokens_per_s"]))
