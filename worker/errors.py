"""Errors a worker raises that callers in other processes tell apart by type."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine's step loop died or was shut down: every request on it failed, none by its own fault."""


class CompileQueueFull(RuntimeError):
    """A grammar compile was turned away because the compile queue (the client's share, or all of
    it) or the lane for long compiles is full: nothing ran; retry later (a 429 at the ingress)."""
