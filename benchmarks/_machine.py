"""The machine a benchmark line was measured on: CPU model, usable cores, Python."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version()}


def machine_with_load() -> dict:
    return {**machine(), "loadavg_1m": round(os.getloadavg()[0], 2)}
