"""The simulated GPU (``--simulate``) and what it shares with ``pagefleet plan``: GPU and model presets, the step roofline, a replica's sizing, config-only checkpoints of known models."""
