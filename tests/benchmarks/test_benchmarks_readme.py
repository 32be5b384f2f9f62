"""benchmarks/README.md lists what a user runs: every script at the top of benchmarks/ and under
probes/ has its line, and every script a line names is there."""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _scripts() -> set[str]:
    top = {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_")}
    return top | {f"probes/{p.name}" for p in (BENCHMARKS / "probes").glob("*.py")}


def test_every_script_has_a_line_and_every_line_a_script():
    listed = set(re.findall(r"^\| `([\w/]+\.(?:py|sh))` \|", (BENCHMARKS / "README.md").read_text(), re.MULTILINE))
    # gpu_check.py, gpu_check_engine.py and gpu_check_moe.py are what gpu_check.sh runs: its line names them.
    assert _scripts() - listed == {"gpu_check.py", "gpu_check_engine.py", "gpu_check_moe.py"}
    assert listed - _scripts() == set()
