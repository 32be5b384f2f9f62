"""Keep freed large blocks in the process on CPU.

glibc hands every allocation above its mmap threshold back to the kernel when freed, so
each step's large temporaries (gathered KV, activations) would page-fault afresh on every
step. Raising the mmap and trim thresholds keeps those pages mapped for reuse, as
tcmalloc/jemalloc would; peak RSS is unchanged since the memory is reused rather than
grown (figures in docs/cpu_engine.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory() -> bool:
    """Apply once per process; False where libc has no mallopt (not glibc)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.info("mallopt unavailable: large CPU temporaries will page-fault on every step")
    _done = ok
    return ok
