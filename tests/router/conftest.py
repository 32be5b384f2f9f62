"""The global scheduler's tests run against both KV indexes: the pure-Python reference and the compiled one."""

from __future__ import annotations

import os
import shutil

import pytest

from pagefleet.kernels.cpu import build as cpu_build
from pagefleet.router.global_scheduler.kv_index_native import KIND_ENV, native_library


def _compiled_index_library():
    lib = native_library()
    if lib is None:
        if shutil.which(os.environ.get(cpu_build.COMPILER_ENV) or "c++") is None:
            pytest.skip("no C++ compiler: the compiled KV index cannot be built here")
        pytest.fail("the compiled KV index did not build on this machine")
    return lib


@pytest.fixture(scope="session")
def compiled_lib():
    """The compiled index's library; the test is skipped on a machine without a C++ compiler, and
    fails where one is but the index did not build."""
    return _compiled_index_library()


@pytest.fixture(params=["python", "native"])
def kv_index_kind(request, monkeypatch):
    """Every core and index the test makes (``new_kv_index()``) is of this kind."""
    if request.param == "native":
        request.getfixturevalue("compiled_lib")
    monkeypatch.setenv(KIND_ENV, request.param)
    return request.param
