"""Where torch.compile keeps what it compiled, so that a restart loads instead of compiling."""

from __future__ import annotations

import os

CACHE_ENV = "PAGEFLEET_CACHE"


def compile_cache_dir() -> str:
    """``$TORCHINDUCTOR_CACHE_DIR`` if set, else ``inductor`` under ``$PAGEFLEET_CACHE``
    (default ``~/.cache/pagefleet``)."""
    root = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "pagefleet"))
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(root, "inductor")


def use_compile_cache() -> str:
    """Point Inductor's caches at compile_cache_dir(); Inductor reads the variable when it first
    touches its cache, so this runs before the first compile of the process."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
