"""`benchmarks/async_output_sim.py` runs and prints one line per run and a ratio line per batch."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_async_output_sim_prints_every_setting_and_their_ratios():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "async_output_sim.py"), "--batches", "4",
                             "--output-len", "6", "--prompt-len", "8", "--rounds", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    runs, (ratio,) = lines[:-1], lines[-1:]
    assert [(r["batch"], r["setting"]) for r in runs] == [(4, "sync"), (4, "async_output"), (4, "async_scheduling")]
    assert all(r["output_tokens_per_s"] > 0 for r in runs)
    # One round each: the medians are the runs themselves, the ratios theirs over the first.
    rates = {r["setting"]: r["output_tokens_per_s"] for r in runs}
    assert ratio["medians"] == {s: round(v) for s, v in rates.items()} and ratio["over"] == "sync"
    assert ratio["ratios"] == {s: round(rates[s] / rates["sync"], 3) for s in ("async_output", "async_scheduling")}
