"""Per-hop timestamps of requests on the serving path: where a request's first token spends its
time between the HTTP client and the engine and back (``benchmarks/hop_trace.py``).

Off unless ``PAGEFLEET_HOP_TRACE`` names a file when the process starts (``pagefleet serve``'s
Ray processes inherit it). Then every process appends one line the first time a request passes
a hop: ``<request id> <hop> <unix time>``. Each line is one ``write`` to a file opened with
``O_APPEND``, so the processes of one machine interleave whole lines, and the times compare
across processes. A debugging aid: it remembers every (request, hop) it wrote.
"""

from __future__ import annotations

import os
import threading
import time

PATH = os.environ.get("PAGEFLEET_HOP_TRACE") or None

_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()  # the engine thread and the event loop both mark
_fd: int | None = None


def mark(request_id: str, hop: str, t: float | None = None) -> None:
    """Record that ``request_id`` passed ``hop`` now (or at ``t``), once; a no-op when off."""
    global _fd
    if PATH is None:
        return
    now = time.time() if t is None else t
    with _lock:
        if (request_id, hop) in _seen:
            return
        _seen.add((request_id, hop))
        if _fd is None:
            _fd = os.open(PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(_fd, f"{request_id} {hop} {now:.6f}\n".encode())
