"""Errors a worker raises that callers in other processes tell apart by type."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine's step loop died or was shut down: every request on it failed, none by its own fault."""
