"""Builds the CPU engine's C++ kernels with the machine's C++ compiler and keeps them across starts.

Each kernel source is plain C++ (OpenMP, no PyTorch headers) with its model constants filled
in; it is compiled once (``-O3 -march=native``, as Inductor builds its own kernels) into
``$PAGEFLEET_CACHE/cpu_kernels`` (default ``~/.cache/pagefleet/cpu_kernels``), under a name
hashed from the source, the flags, the compiler's version and this CPU, and loaded with
ctypes. The OpenMP runtime it links is the one torch already loaded (same soname), so its
threads are torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "PAGEFLEET_CACHE"
COMPILER_ENV = "CXX"
# -ffast-math: reassociated sums (vectorised dot products and norms) and the vector exp of the
# C library. The kernels never form an infinity or NaN from finite inputs, which is what
# fast-math assumes. They apply to compiling only: a shared library linked with -ffast-math
# carries crtfastmath.o, which turns on flush-to-zero and denormals-are-zero for the whole
# process when it loads, and Python's own floats then compare 5e-324 as 0.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-fopenmp", "-shared")

# Compiler runs of this process (the tests count them: one per source, none on a cache hit).
builds = 0


def kernel_cache_dir() -> Path:
    """``cpu_kernels`` under ``$PAGEFLEET_CACHE`` (default ``~/.cache/pagefleet``)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "pagefleet")
    return Path(root) / "cpu_kernels"


def _cpu_identity() -> str:
    # -march=native builds for this CPU: a cache shared with another machine must not hand it over.
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


@functools.cache
def _compiler() -> tuple[str, str]:
    cxx = os.environ.get(COMPILER_ENV) or "c++"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"the CPU engine's compiled kernels need a C++ compiler ({cxx!r}: {e}); install one "
                           f"(g++), name it in ${COMPILER_ENV}, or run with enforce_eager=True") from e
    return cxx, version


@functools.cache
def load_library(name: str, source: str) -> ctypes.CDLL:
    """The library built from ``source``: from the cache, else compiled into it."""
    global builds
    cxx, version = _compiler()
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS)
    key = hashlib.sha256("\0".join([source, flags, cxx, version, _cpu_identity()]).encode()).hexdigest()
    path = kernel_cache_dir() / f"{name}_{key[:24]}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            src, obj, lib = (Path(tmp) / f"{name}{ext}" for ext in (".cpp", ".o", ".so"))
            src.write_text(source)
            compile_, link = ([cxx, *COMPILE_FLAGS, "-c", "-o", str(obj), str(src)],
                              [cxx, *LINK_FLAGS, "-o", str(lib), str(obj)])
            for cmd in (compile_, link):
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"building the CPU kernel {name} failed ({' '.join(cmd)}):\n"
                                       f"{done.stderr[-2000:]}\nrun with enforce_eager=True to use the PyTorch twins")
            os.replace(lib, path)  # atomic: processes building the same kernel at once each publish a whole file
        builds += 1
        logger.info("compiled the CPU kernel %s in %.1f s: %s", name, time.perf_counter() - start, path)
    return ctypes.CDLL(str(path))
