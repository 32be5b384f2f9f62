"""Where compiled kernels are kept across starts: pagefleet's cache directory, unless the user
chose Inductor's own; Inductor's default under /tmp, which importing torch._dynamo writes into
the environment, is no choice of the user's."""

from __future__ import annotations

import os

import torch._dynamo  # noqa: F401  (what writes Inductor's default into the environment)
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

from pagefleet.kernels.compile_cache import use_compile_cache


def test_inductor_default_gives_way_to_pagefleet_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path))
    assert use_compile_cache() == str(tmp_path / "inductor")
    assert cache_dir() == str(tmp_path / "inductor")  # what Inductor itself will use


def test_home_cache_when_nothing_is_set(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("PAGEFLEET_CACHE", raising=False)
    assert use_compile_cache() == os.path.join(os.path.expanduser("~"), ".cache", "pagefleet", "inductor")


def test_a_directory_the_user_chose_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path / "pf"))
    assert use_compile_cache() == str(tmp_path / "mine")
