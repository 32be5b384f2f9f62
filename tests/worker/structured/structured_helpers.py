"""What the structured-outputs tests share."""

from __future__ import annotations

import threading


def slow_compile_of(cache, monkeypatch, spec: str) -> threading.Event:
    """Make ``cache`` compile ``spec`` only once the returned event is set (others as before)."""
    release = threading.Event()
    real = cache._compile

    def slow_for_one_spec(key):
        if key.spec == spec:
            release.wait(30)
        return real(key)

    monkeypatch.setattr(cache, "_compile", slow_for_one_spec)
    return release
