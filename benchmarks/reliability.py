"""The reliability battery at the issue's full sizes, with its figures as JSON lines.

Runs the reliability tests on a local Ray cluster, the ``slow`` variants included
(200 cancelled streams, 200 requests sent after a replica is killed, 5 rounds of
overload at 3x capacity), and prints each figure they record as one JSON line
with the machine it ran on. docs/reliability.md quotes these lines.

    .venv/bin/python benchmarks/reliability.py            # full battery (~5 min on 2 cores)
    .venv/bin/python benchmarks/reliability.py --quick    # the CI sizes only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/serving/test_reliability_cluster.py"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI sizes only (no slow variants)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    with tempfile.TemporaryDirectory() as tmp:
        figures = Path(tmp) / "figures.jsonl"
        env = {**os.environ, "PAGEFLEET_FIGURES": str(figures), "OMP_WAIT_POLICY": "PASSIVE"}
        marker = ["-m", "not slow" if args.quick else "slow or not slow"]  # pyproject's default skips slow
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marker, *TESTS],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        lines = figures.read_text().splitlines() if figures.exists() else []
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    load = {"loadavg_1m_start": round(load_start, 2), "loadavg_1m_end": round(os.getloadavg()[0], 2)}
    for line in lines:
        print(json.dumps({**json.loads(line), "machine": machine, **load}))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(json.dumps({"figure": "battery", "pytest_exit_code": done.returncode, "summary": summary,
                      "machine": machine, **load}))
    if done.returncode != 0:
        print(done.stdout[-5000:], file=sys.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
