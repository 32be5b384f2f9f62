"""Peak resident memory of a process tree; standard library only, so the peer venv's runner can use it."""

from __future__ import annotations

import os
from pathlib import Path


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def tree_peak_rss_mib(root: int | None = None) -> float:
    """Sum of VmHWM (peak resident set) over a process and its live descendants.

    VmHWM, not getrusage: ru_maxrss survives execve, so a child started by a parent
    that once held a model would report the parent's peak. Descendants count because
    some systems keep the model in a child process (vLLM's engine core) or fork
    compile workers."""
    total, todo, seen = 0.0, [root or os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024.0  # kB
            todo += _children(pid)
        except OSError:
            pass  # exited meanwhile
    return total
