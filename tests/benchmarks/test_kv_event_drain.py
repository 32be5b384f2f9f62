"""`benchmarks/kv_event_drain.py` runs both ways over the same requests and counts their drains."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kv_event_drain_runs_both_ways_over_the_same_steps():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_event_drain.py"), "--concurrency", "4",
                             "--requests", "6", "--output-len", "5", "--interval-s", "3600", "--rounds", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    every, paced = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert (every["drain"], paced["drain"]) == ("every step", "every 3600 s")
    assert every["tokens"] == paced["tokens"] == 6 * 5 and every["steps"] == paced["steps"]
    assert every["drains"] == every["steps"] and paced["drains"] == 0  # the hour never passed
