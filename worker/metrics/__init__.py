"""Engine metrics and stats: definitions, per-step collection, the Ray recorder and the stats line."""
