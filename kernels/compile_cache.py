"""Where torch.compile keeps what it compiled, so that a restart loads instead of compiling."""

from __future__ import annotations

import os

from torch._inductor.runtime.cache_dir_utils import default_cache_dir

CACHE_ENV = "PAGEFLEET_CACHE"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> str:
    """``$TORCHINDUCTOR_CACHE_DIR`` if the user set it, else ``inductor`` under
    ``$PAGEFLEET_CACHE`` (default ``~/.cache/pagefleet``).

    Importing torch._dynamo writes Inductor's default (a directory under /tmp, which a reboot
    empties) into ``$TORCHINDUCTOR_CACHE_DIR``, so that value counts as unset."""
    chosen = os.environ.get(INDUCTOR_ENV)
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return chosen
    root = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "pagefleet"))
    return os.path.join(root, "inductor")


def use_compile_cache() -> str:
    """Point Inductor's caches at compile_cache_dir(), for the whole process; Inductor reads the
    variable each time it opens its cache, so this runs before the first compile."""
    os.environ[INDUCTOR_ENV] = compile_cache_dir()
    return os.environ[INDUCTOR_ENV]
